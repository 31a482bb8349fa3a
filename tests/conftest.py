"""Shared fixtures: tiny checkpoints built once per test session,
transformers' greedy generate() as the reference, and a local Ray cluster with
Serve per test module that asks for one."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch

# Triton kernels run on CPU tensors under Triton's interpreter when there is no GPU;
# it must be chosen before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

PARITY_PRESETS = ("tiny", "tiny-mqa", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-llama3-rope")


def cpp_toolchain_present() -> bool:
    """A C++ compiler and ninja, which torch needs to build pdserve's CPU kernels: where
    they are, the kernels' tests must run (a build error is a failure, not a skip)."""
    import shutil

    from torch.utils.cpp_extension import is_ninja_available
    return bool(shutil.which("c++") or shutil.which("g++")) and is_ninja_available()


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
        self.eos = self.model.generation_config.eos_token_id     # one id or a list (generation_config.json's)
        self.pad = self.eos[0] if isinstance(self.eos, list) else self.eos

    @functools.lru_cache(maxsize=None)
    def greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        """Greedy continuation; stops at EOS unless `ignore_eos` (as the engine's ignore_eos)."""
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                      do_sample=False, eos_token_id=[] if ignore_eos else self.eos,
                                      pad_token_id=self.pad,
                                      attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster no bigger than a 2-core machine (2 CPUs; 4 logical
    GPUs for the bundle-probe test) with Serve's HTTP on a free port, its processes
    in the environment of the local cluster `pdserve serve` starts (gRPC calls between
    deployments, ...); yields the port."""
    import ray
    from ray import serve

    from cluster.serving.local_cluster import local_cluster_env
    from engine.tp_group import free_port
    saved = dict(os.environ)
    os.environ.update(local_cluster_env({}))     # read by the raylet this starts and its workers
    ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:       # a failed start must not leave Ray up for every later module's ray.init
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
        serve.shutdown()
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def tokenizer(model_dirs):
    """The tiny checkpoint's tokenizer."""
    from engine.tokenizer import load_tokenizer
    return load_tokenizer(str(model_dirs["tiny"]))


@pytest.fixture(scope="session")
def reference(model_dirs):
    cache: dict[str, Reference] = {}

    def get(preset: str) -> Reference:
        if preset not in cache:
            cache[preset] = Reference(model_dirs[preset])
        return cache[preset]

    return get


def _live_children() -> list[str]:
    """Processes whose parent is this test process (zombies excluded)."""
    import os
    me = str(os.getpid())
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], fields[1]
        if ppid == me and state != "Z":
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            if "multiprocessing.resource_tracker" in cmdline:
                continue  # the standard library's helper; it exits with the interpreter
            found.append(f"{entry}: {cmdline[:120]}")
    return found


@pytest.fixture(autouse=True)
def deployments_see_no_gpus(monkeypatch):
    """A deployment that names no device takes the GPUs there are: the tests that build
    one see none, wherever they run (a test about that default sets its own)."""
    import cluster.app_builder
    import cluster.cli.serve_command
    monkeypatch.setattr(cluster.cli.serve_command, "visible_gpus", lambda: 0)
    monkeypatch.setattr(cluster.app_builder, "_cluster_gpus", lambda: 0)


@pytest.fixture(scope="session", autouse=True)
def no_process_left_behind():
    """Every engine rank process the tests start must be gone when they end."""
    yield
    import gc
    import time
    gc.collect()
    deadline = time.monotonic() + 15
    while _live_children() and time.monotonic() < deadline:
        time.sleep(0.2)
    leftover = _live_children()
    assert not leftover, f"processes left running after the tests: {leftover}"
