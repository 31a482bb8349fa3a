"""Loads a checkpoint's tokenizer offline."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}. The model directory needs "
                         "tokenizer.json / tokenizer_config.json, or name a directory that has them "
                         "(LLM(tokenizer=DIR), pdserve serve --tokenizer DIR, model.tokenizer in a deployment "
                         "file)") from None
