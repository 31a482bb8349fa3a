"""Shared fixtures: tiny checkpoints built once per test session, and
transformers' greedy generate() as the reference."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

PARITY_PRESETS = ("tiny", "tiny-mqa", "tiny-qwen2", "tiny-mistral", "tiny-llama3-rope")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """preset name -> checkpoint directory (built lazily, once per session)."""
    from engine.tiny_model import make_tiny_model
    root = tmp_path_factory.mktemp("models")

    class _Dirs(dict):
        def __missing__(self, preset: str) -> Path:
            path = make_tiny_model(root / preset, preset, seed=0)
            self[preset] = path
            return path

    return _Dirs()


class Reference:
    """transformers' greedy generate() on one checkpoint, memoised per prompt."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id

    @functools.lru_cache(maxsize=None)
    def greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=self.eos, pad_token_id=self.eos,
                                      attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="session")
def reference(model_dirs):
    cache: dict[str, Reference] = {}

    def get(preset: str) -> Reference:
        if preset not in cache:
            cache[preset] = Reference(model_dirs[preset])
        return cache[preset]

    return get
