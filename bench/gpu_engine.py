"""pdserve on one GPU with a Llama-3-8B-shaped model: ceilings, decode MBU, prefill MFU.

    python3 bench/gpu_engine.py [--quick] [--skip-transformers] [--systems pdserve,pdserve-eager-old,transformers]
                                [--model-dir /tmp/llama3-8b-random] [--out bench/results/gpu_engine.json]
                                [--budget-s 440]

One command builds, checks and times everything, each phase in its own subprocess (so that
each system gets the whole GPU, and a crash or hang costs one phase, not the run):

1. ceilings, measured in this run: device-to-device copy bandwidth (a 4 GiB copy, bytes
   read + written over time, median of 10, CUDA events) and the bf16 matmul rate
   (8192 x 8192 x 8192 on random data, median);
2. a random-weight Llama-3-8B-shaped checkpoint in HF format (vocab 128256, hidden 4096,
   32 layers, 32 heads, 8 KV heads, intermediate 14336, Llama-3.1 RoPE (theta 500000,
   factor 8, original 8192, max_position_embeddings 131072; the engines run with
   max_model_len 8192), bf16, untied embeddings; ~16 GB), generated on the GPU from a seeded generator and written as 4
   safetensors shards + index + config.json + a synthetic 128256-token byte-level BPE
   tokenizer (Llama-3 layout: bos 128000, eos 128001), reused when --model-dir already
   holds one (a marker file records the recipe);
3. decode step time at batch 1, 8, 32, 64, 128 x context 512, 2048 for
   - pdserve: the engine's defaults (Triton paged attention, CUDA graphs, fused ops),
   - pdserve-sync (not run by default): the defaults with async_scheduling=False,
   - pdserve-eager-old: attention_backend="torch", enforce_eager=True, fused_ops=False,
     skinny_gemm=False, async_scheduling=False,
   - transformers generate() in bf16 with cache_implementation="static", uncompiled at
     every point, then torch.compile'd (generate's auto-compile, reduce-overhead) at as
     many points as the time budget allows (each new shape recompiles);
   pdserve: B requests of C random prompt tokens, stepped until each has its first token,
   then W warm-up and K timed decode steps (time.perf_counter around LLMEngine.step(),
   which returns after the sampled tokens reach the host); transformers: per-step
   timestamps from a logits processor that synchronizes. Median step time.
   floor = (weight bytes + KV bytes) / copy bandwidth, with weight bytes = every parameter
   but the embedding table (lm_head included) in bf16, and KV bytes = the K/V of every
   token each sequence attends to during the timed steps (mean context ~ C + W + K/2).
   MBU = floor / median step time;
4. prefill throughput at 512, 1024, 2048, 4096 tokens (one prompt per step, max_tokens=1,
   fresh random prompts, median of a few): MFU = FLOPs / time / measured matmul rate with
   FLOPs = 2 x (linear-layer parameters except lm_head) x P + 2 x hidden x vocab (one
   logits row) + 4 x layers x heads x head_dim x P^2 / 2 (causal attention); the same for
   the old eager engine and a transformers forward of P tokens (logits_to_keep=1);
5. targets next to the figures: decode MBU >= 85% at batch 1 and >= 75% at batch 64,
   prefill MFU >= 60% at 2048 tokens.

Prints the device, the ceilings, the time spent per phase and markdown tables (ready for
a README), and writes JSON to --out (after every phase, so an interrupted run keeps what
it measured). A failing system or point is recorded as an error string; it never stops
the run. --budget-s bounds the whole run: every phase gets a deadline, points that would
not fit are recorded as skipped, and a phase past its deadline is killed.

--quick is a smoke test: batch 1 and 64 at context 512, prefill 2048, fewer steps, no
torch.compile. A CPU smoke test of the whole pipeline with a tiny model of the same
format (options the engine lacks are dropped there):

    python3 bench/gpu_engine.py --device cpu --quick --out /tmp/gpu_engine_cpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GIB = 1 << 30
MARKER = ".pdserve-random-checkpoint.json"
MARKER_VERSION = 1
NUM_SPECIAL_TOKENS = 256          # Llama-3 layout: the last 256 ids are special (bos, eos, reserved)

# HF LlamaConfig fields of the checkpoints this script writes
SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=131072),
    # same format, for checking the writer and the pipeline on a CPU
    "tiny": dict(vocab_size=128256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, max_position_embeddings=131072),
}
ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=8192)
RMS_NORM_EPS = 1e-5
MAX_MODEL_LEN = 8192              # the engines' context limit (the checkpoint allows 131072, as Llama 3.1 does)

SYSTEMS = {
    "pdserve": {},                                   # the engine's defaults
    # the engine's defaults but with every step read back before the next is scheduled
    "pdserve-sync": {"async_scheduling": False},
    "pdserve-eager-old": {"attention_backend": "torch", "enforce_eager": True, "fused_ops": False,
                          "skinny_gemm": False, "async_scheduling": False},
    "transformers": None,
}
TARGETS = (  # (kind, batch or prompt length, minimum)
    ("decode_mbu", 1, 0.85),
    ("decode_mbu", 64, 0.75),
    ("prefill_mfu", 2048, 0.60),
)
# phase -> (longest it may take, seconds it needs to be worth starting)
PHASE_LIMITS = {
    "ceilings": (60, 15),
    "checkpoint": (200, 30),
    "pdserve": (160, 45),
    "pdserve-sync": (160, 45),
    "pdserve-eager-old": (120, 40),
    "transformers": (260, 45),
}
KILL_GRACE_S = 15


def log(msg: str) -> None:
    print(msg, flush=True)


# ===================================================================== model arithmetic

@dataclasses.dataclass(frozen=True)
class ModelMath:
    """Bytes and FLOPs of a Llama-shaped model (bf16), via the engine's memory planner."""
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    dtype_bytes: int = 2

    @classmethod
    def from_shape(cls, shape: dict) -> "ModelMath":
        return cls(shape["vocab_size"], shape["hidden_size"], shape["num_hidden_layers"],
                   shape["num_attention_heads"], shape["num_key_value_heads"],
                   shape["hidden_size"] // shape["num_attention_heads"], shape["intermediate_size"])

    def model_config(self):
        from engine.model.model_config import ModelConfig
        return ModelConfig(architecture="LlamaForCausalLM", vocab_size=self.vocab, hidden_size=self.hidden,
                           intermediate_size=self.intermediate, num_layers=self.layers, num_heads=self.heads,
                           num_kv_heads=self.kv_heads, head_dim=self.head_dim, max_position_embeddings=8192,
                           rms_norm_eps=RMS_NORM_EPS, rope_theta=ROPE["rope_theta"])

    @property
    def parameters(self) -> int:
        from engine.memory_planner import rank_parameters
        return rank_parameters(self.model_config(), 1)

    @property
    def weight_bytes_per_step(self) -> int:
        """Every parameter but the embedding table (whose rows a step barely touches)."""
        return (self.parameters - self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        from engine.memory_planner import kv_bytes_per_token
        return kv_bytes_per_token(self.model_config(), 1, "bfloat16")

    @property
    def matmul_parameters(self) -> int:
        """Weights of the linear layers a prompt token goes through (all but lm_head)."""
        h, d = self.hidden, self.head_dim
        per_layer = h * (self.heads + 2 * self.kv_heads) * d + self.heads * d * h + 3 * h * self.intermediate
        return self.layers * per_layer

    def prefill_flops(self, tokens: int) -> float:
        linear = 2 * self.matmul_parameters * tokens
        lm_head = 2 * self.hidden * self.vocab                       # the one sampled row
        attention = 4 * self.layers * self.heads * self.head_dim * tokens * tokens / 2   # causal
        return float(linear + lm_head + attention)

    def decode_floor_s(self, kv_tokens_per_step: float, bandwidth: float) -> float:
        """Time to read the weights and the attended K/V once at `bandwidth` bytes/s."""
        return (self.weight_bytes_per_step + self.kv_bytes_per_token * kv_tokens_per_step) / bandwidth


def kv_blocks_needed(batch_sizes, contexts, prefill_lens, budget_tokens: int, warmup: int, steps: int,
                     block_size: int = 16) -> int:
    """KV blocks for the largest decode point (prompt, the tokens generated while the
    other prompts prefill, warm-up and timed steps, a margin) or the longest prompt."""
    need = 0
    for b in batch_sizes:
        for c in contexts:
            extra = -(-b * c // budget_tokens) + warmup + steps + 32
            need = max(need, b * -(-(c + extra) // block_size))
    need = max(need, 2 * -(-(max(prefill_lens, default=0) + 16) // block_size))
    return max(need, -(-MAX_MODEL_LEN // block_size)) + 64     # the engine wants one max_model_len sequence


# ========================================================================== checkpoint

def tensor_specs(shape: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(HF name, shape, init kind) of every tensor, in file order."""
    v, h, inter = shape["vocab_size"], shape["hidden_size"], shape["intermediate_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    specs = [("model.embed_tokens.weight", (v, h), "embedding")]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,), "norm"),
            (p + "self_attn.q_proj.weight", (heads * d, h), "linear"),
            (p + "self_attn.k_proj.weight", (kv * d, h), "linear"),
            (p + "self_attn.v_proj.weight", (kv * d, h), "linear"),
            (p + "self_attn.o_proj.weight", (h, heads * d), "linear"),
            (p + "post_attention_layernorm.weight", (h,), "norm"),
            (p + "mlp.gate_proj.weight", (inter, h), "linear"),
            (p + "mlp.up_proj.weight", (inter, h), "linear"),
            (p + "mlp.down_proj.weight", (h, inter), "linear"),
        ]
    specs += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "linear")]
    return specs


def plan_shards(specs, num_shards: int) -> list[list[int]]:
    """Splits the tensors, in order, into at most `num_shards` runs of similar byte size."""
    sizes = [2 * math.prod(s) for _, s, _ in specs]
    target = sum(sizes) / num_shards
    shards: list[list[int]] = [[]]
    acc = 0
    for i, n in enumerate(sizes):
        if shards[-1] and acc + n / 2 > target * len(shards) and len(shards) < num_shards:
            shards.append([])
        shards[-1].append(i)
        acc += n
    return shards


def safetensors_header(entries: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file of bf16 tensors stored in order."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in entries:
        n = 2 * math.prod(shape)
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def recipe(shape_name: str, seed: int) -> dict:
    return {"version": MARKER_VERSION, "shape": shape_name, "config": SHAPES[shape_name], "rope": ROPE,
            "seed": seed}


def checkpoint_is_current(out: Path, shape_name: str, seed: int) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("recipe") != recipe(shape_name, seed):
        return False
    return all((out / name).is_file() and (out / name).stat().st_size == size
               for name, size in marker.get("files", {}).items())


def write_config(out: Path, shape: dict) -> None:
    from transformers import LlamaConfig
    vocab = shape["vocab_size"]
    config = LlamaConfig(
        **shape, rms_norm_eps=RMS_NORM_EPS, rope_parameters=dict(ROPE), tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        bos_token_id=vocab - NUM_SPECIAL_TOKENS, eos_token_id=vocab - NUM_SPECIAL_TOKENS + 1, dtype="bfloat16")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)


def write_tokenizer(out: Path, vocab_size: int, max_len: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer with exactly `vocab_size` ids, Llama-3 style: the 256
    byte symbols, then random multi-character pieces (no merges: text encodes to bytes,
    but every id decodes), then 256 special tokens (bos, eos, reserved). With it the
    engine detokenizes every id the model can emit, at a realistic cost."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    common = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ"]    # Ġ: a space, byte-level
    rng = random.Random(seed)
    while len(vocab) < vocab_size - NUM_SPECIAL_TOKENS:
        piece = "".join(rng.choice(common if rng.random() < 0.9 else alphabet) for _ in range(rng.randint(2, 7)))
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(NUM_SPECIAL_TOKENS - 2)]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, wanted {vocab_size}")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                            clean_up_tokenization_spaces=False, model_max_length=max_len).save_pretrained(out)


def write_random_llama(out_dir: str | Path, shape_name: str = "llama3-8b", *, device: str = "cuda", seed: int = 0,
                       num_shards: int = 4) -> dict:
    """Writes (or reuses) a random-weight HF Llama checkpoint in `out_dir`; returns timings.

    Weights come from a seeded torch generator on `device` (std 1/sqrt(fan_in) for linear
    layers and lm_head, 1 for the embedding, 1 + 0.02 N(0,1) for norms), in bf16, streamed
    through a pinned buffer into hand-written safetensors shards. The directory is built
    under a temporary sibling name and renamed into place, so a killed run never leaves a
    half-written checkpoint that looks complete."""
    import torch

    out = Path(out_dir)
    shape = SHAPES[shape_name]
    if checkpoint_is_current(out, shape_name, seed):
        return {"reused": True, "path": str(out)}
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} exists and was not written by this script; pass another --model-dir")
    for stale in out.parent.glob(f"{out.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = out.parent / f"{out.name}.partial-{os.getpid()}"
    staging.mkdir(parents=True)
    timings: dict = {"reused": False, "path": str(out)}
    try:
        t0 = time.perf_counter()
        write_config(staging, shape)
        write_tokenizer(staging, shape["vocab_size"], shape["max_position_embeddings"])
        timings["config_tokenizer_s"] = round(time.perf_counter() - t0, 2)

        t0 = time.perf_counter()
        specs = tensor_specs(shape)
        shards = plan_shards(specs, num_shards)
        dev = torch.device(device)
        gen = torch.Generator(device=dev).manual_seed(seed)
        max_bytes = max(2 * math.prod(s) for _, s, _ in specs)
        staging_buf = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        weight_map, files, total = {}, {}, 0
        for k, idx in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            with open(staging / fname, "wb") as f:
                f.write(safetensors_header([(specs[i][0], specs[i][1]) for i in idx]))
                for i in idx:
                    name, tshape, kind = specs[i]
                    t = torch.randn(tshape, generator=gen, device=dev, dtype=torch.bfloat16)
                    if kind == "linear":
                        t.mul_(1.0 / math.sqrt(tshape[1]))
                    elif kind == "norm":
                        t.mul_(0.02).add_(1.0)
                    flat = t.reshape(-1).view(torch.uint8)
                    buf = staging_buf[: flat.numel()]
                    buf.copy_(flat, non_blocking=dev.type == "cuda")
                    if dev.type == "cuda":
                        torch.cuda.current_stream(dev).synchronize()
                    f.write(buf.numpy().data)
                    weight_map[name] = fname
                    total += flat.numel()
                    del t, flat
            files[fname] = (staging / fname).stat().st_size
        (staging / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        timings["weights_s"] = round(time.perf_counter() - t0, 2)
        timings["weight_bytes"] = total
        (staging / MARKER).write_text(json.dumps({"recipe": recipe(shape_name, seed), "files": files}, indent=2))
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return timings


# ============================================================================ workers

class Deadline:
    def __init__(self, at: float):
        self.at = at

    def left(self) -> float:
        return self.at - time.time()


def save_json(path: str | Path, data: dict) -> None:
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:500]}"


def _median_time(fn, device, reps: int, warmup: int, inner: int = 1) -> float:
    import torch
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def worker_ceilings(spec: dict, out: dict, save) -> None:
    import torch
    import transformers
    dev = torch.device(spec["device"])
    out["torch"] = torch.__version__
    out["transformers"] = transformers.__version__
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out.update(device_name=props.name, memory_gib=round(props.total_memory / GIB, 1),
                   sm_count=props.multi_processor_count, cuda=torch.version.cuda)
    else:
        out.update(device_name=f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    save()
    nbytes = spec["copy_bytes"]
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)     # < 2**31 elements: one kernel
    dst = torch.empty_like(src)
    t = _median_time(functools.partial(dst.copy_, src), dev, reps=10, warmup=3)
    out["copy"] = {"bytes_copied": nbytes, "median_s": t, "bandwidth_bytes_per_s": 2 * nbytes / t}
    log(f"[ceilings] copy {nbytes / GIB:.1f} GiB: {t * 1e3:.2f} ms -> {2 * nbytes / t / 1e12:.3f} TB/s (read+write)")
    del src, dst
    save()
    n = spec["matmul_n"]
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, generator=g, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    t = _median_time(lambda: torch.matmul(a, b, out=c), dev, reps=8, warmup=5, inner=5)
    out["matmul"] = {"n": n, "median_s": t, "flops_per_s": 2 * n ** 3 / t}
    log(f"[ceilings] bf16 matmul {n}^3: {t * 1e3:.3f} ms -> {2 * n ** 3 / t / 1e12:.1f} TFLOP/s")


def worker_checkpoint(spec: dict, out: dict, save) -> None:
    t0 = time.perf_counter()
    out.update(write_random_llama(spec["model_dir"], spec["shape"], device=spec["device"], seed=spec["seed"]))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    log(f"[checkpoint] {'reused' if out['reused'] else 'written'}: {out['path']} ({out['seconds']:.1f} s)")


def _engine_options(spec: dict, system: str) -> tuple[dict, list[str]]:
    from engine.engine_config import EngineConfig
    opts = dict(dtype="bfloat16", device=spec["device"], max_model_len=MAX_MODEL_LEN,
                max_num_seqs=max(spec["batch_sizes"]),
                max_num_batched_tokens=spec["max_num_batched_tokens"], num_kv_blocks=spec["num_kv_blocks"],
                **SYSTEMS[system])
    dropped = []
    if spec["drop_unknown_options"]:       # CPU smoke test against an engine without the new options
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        dropped = [k for k in opts if k not in known]
        for k in dropped:
            del opts[k]
    return opts, dropped


def _prompt(rng: random.Random, n: int, high: int) -> list[int]:
    return [rng.randrange(high) for _ in range(n)]


def _point_order(batch_sizes, contexts) -> list[tuple[int, int]]:
    """Decode points, the targets' points first (they run first when time is short)."""
    points = [(b, c) for c in contexts for b in batch_sizes]
    return sorted(points, key=lambda p: (p[0] not in (1, 64), p[1], p[0]))


def worker_pdserve(spec: dict, out: dict, save) -> None:
    import torch

    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    system = spec["system"]
    deadline = Deadline(spec["deadline"])
    opts, dropped = _engine_options(spec, system)
    out.update(options=opts, dropped_options=dropped, prefill=[], decode=[])
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=spec["model_dir"], **opts))
    out["engine_start_s"] = round(time.perf_counter() - t0, 2)
    log(f"[{system}] engine started in {out['engine_start_s']:.1f} s (load + KV cache + graph capture)")
    save()
    high = spec["prompt_id_high"]
    rng = random.Random(spec["seed"])

    # runner.launch time next to the whole step, where the engine has one: forward + sampling when
    # the step is read back at once; with async scheduling, the host's time to queue the step
    model_times: list[float] = []
    runner = getattr(engine, "runner", None)
    if runner is not None and hasattr(runner, "launch"):
        original = runner.launch

        def timed_launch(*a, **k):
            t = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                model_times.append(time.perf_counter() - t)
        runner.launch = timed_launch

    def drain(rids) -> None:
        for rid in rids:
            try:
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort between points
                pass

    prefill_rate = None
    for P in spec["prefill_lens"]:
        rec: dict = {"tokens": P}
        out["prefill"].append(rec)
        if deadline.left() < 5 + (1 + spec["prefill_reps"]) * P / (prefill_rate or 2000):
            rec["skipped"] = "time budget"
            continue
        rids: list[str] = []
        try:
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            times, steps = [], []
            for rep in range(1 + spec["prefill_reps"]):
                prompt = _prompt(random.Random(spec["seed"] * 1000 + P), P, high) if rep == 0 else \
                    _prompt(rng, P, high)   # rep 0: the warm-up, the same prompt in every system
                rid = engine.add_request(None, prompt, params)
                rids.append(rid)
                t = time.perf_counter()
                n, outs = 0, []
                while True:
                    outs = engine.step()
                    n += 1
                    if any(o.request_id == rid and o.finished for o in outs) or n > 1000:
                        break
                dt = time.perf_counter() - t
                if rep == 0:
                    rec["first_token"] = next(o.token_ids[0] for o in outs if o.request_id == rid)
                else:
                    times.append(dt)
                    steps.append(n)
            rec.update(median_s=statistics.median(times), times_s=times, steps=steps)
            prefill_rate = P / rec["median_s"]
            log(f"[{system}] prefill {P}: {rec['median_s'] * 1e3:.1f} ms ({P / rec['median_s']:,.0f} tok/s)")
        except Exception as exc:  # noqa: BLE001 - recorded; the next point runs
            traceback.print_exc()
            rec["error"] = error_text(exc)
        finally:
            drain(rids)
        save()

    W, K = spec["warmup_steps"], spec["decode_steps"]
    for B, C in _point_order(spec["batch_sizes"], spec["contexts"]):
        rec = {"batch": B, "context": C}
        out["decode"].append(rec)
        estimate = 5 + B * C / (prefill_rate or 2000) * 1.5 + (W + K) * 0.1
        if deadline.left() < estimate:
            rec["skipped"] = "time budget"
            log(f"[{system}] decode B={B} C={C}: skipped (time budget)")
            continue
        rids = []
        try:
            gc.collect()
            params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
            rids = [engine.add_request(None, _prompt(rng, C, high), params) for _ in range(B)]
            ntok: dict[str, int] = {}
            t = time.perf_counter()
            steps = 0
            while len(ntok) < B:
                for o in engine.step():
                    ntok[o.request_id] = len(o.prompt_token_ids) + len(o.token_ids)
                steps += 1
                if steps > 100_000:
                    raise RuntimeError("prompts never finished prefilling")
            rec["prefill_phase_s"] = round(time.perf_counter() - t, 3)
            rec["prefill_phase_steps"] = steps
            for _ in range(W):
                for o in engine.step():
                    ntok[o.request_id] = len(o.prompt_token_ids) + len(o.token_ids)
            times, contexts, irregular = [], [], 0
            model_times.clear()
            for _ in range(K):
                context = sum(ntok.values())      # tokens whose K/V this step reads (the new one included)
                t = time.perf_counter()
                outs = engine.step()
                times.append(time.perf_counter() - t)
                contexts.append(context)
                if len(outs) != B:
                    irregular += 1
                for o in outs:
                    ntok[o.request_id] = len(o.prompt_token_ids) + len(o.token_ids)
            stats = getattr(engine, "last_step", None)
            rec.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times),
                       kv_tokens_per_step=statistics.mean(contexts), mean_context=statistics.mean(contexts) / B,
                       steps=K, irregular_steps=irregular,
                       last_step_decode_seqs=getattr(stats, "num_decode_seqs", None))
            if len(model_times) == K:
                rec["runner_median_s"] = statistics.median(model_times)
            log(f"[{system}] decode B={B} C={C}: {rec['median_s'] * 1e3:.2f} ms/step"
                + (f" (runner {rec['runner_median_s'] * 1e3:.2f} ms)" if "runner_median_s" in rec else "")
                + (f", {irregular} irregular steps" if irregular else ""))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rec["error"] = error_text(exc)
        finally:
            drain(rids)
        save()
    if torch.cuda.is_available():
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    engine.shutdown()


def worker_transformers(spec: dict, out: dict, save) -> None:
    import torch
    import transformers
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        LogitsProcessor,
        LogitsProcessorList,
    )
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()

    deadline = Deadline(spec["deadline"])
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    out.update(transformers=transformers.__version__, prefill=[], decode=[], decode_compiled=[])
    t0 = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16, device_map=str(dev))
    except Exception as exc:  # noqa: BLE001 - e.g. device_map needing accelerate: load, then move
        out["device_map_error"] = error_text(exc)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.bfloat16).to(dev)
    model.eval()
    model.generation_config.eos_token_id = None      # never stop early: every step is timed
    pad = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    out["load_s"] = round(time.perf_counter() - t0, 2)
    out["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    log(f"[transformers] model loaded in {out['load_s']:.1f} s ({out['attn_implementation']})")
    save()
    high = spec["prompt_id_high"]
    gen = torch.Generator().manual_seed(spec["seed"])

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    prefill_rate = None
    for P in spec["prefill_lens"]:
        rec: dict = {"tokens": P}
        out["prefill"].append(rec)
        if deadline.left() < 5 + (1 + spec["prefill_reps"]) * P / (prefill_rate or 2000):
            rec["skipped"] = "time budget"
            continue
        try:
            times = []
            for rep in range(1 + spec["prefill_reps"]):
                if rep == 0:   # the warm-up: the same prompt in every system
                    ids = torch.tensor([_prompt(random.Random(spec["seed"] * 1000 + P), P, high)])
                else:
                    ids = torch.randint(0, high, (1, P), generator=gen)
                ids = ids.to(dev)
                sync()
                t = time.perf_counter()
                with torch.inference_mode():
                    logits = model(input_ids=ids, logits_to_keep=1).logits
                sync()
                dt = time.perf_counter() - t
                if rep == 0:
                    rec["first_token"] = int(logits[0, -1].argmax())
                else:
                    times.append(dt)
                del logits
            rec.update(median_s=statistics.median(times), times_s=times)
            prefill_rate = P / rec["median_s"]
            log(f"[transformers] prefill {P}: {rec['median_s'] * 1e3:.1f} ms ({prefill_rate:,.0f} tok/s)")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rec["error"] = error_text(exc)
        save()

    class StepTimer(LogitsProcessor):
        """Called once per generated token, after its forward pass: a timestamp per step."""

        def __init__(self):
            self.stamps: list[float] = []

        def __call__(self, input_ids, scores):
            sync()
            self.stamps.append(time.perf_counter())
            return scores

    chunking = hasattr(GenerationConfig(), "prefill_chunk_size")
    K = spec["decode_steps"]

    def decode_point(B: int, C: int, compiled: bool, W: int) -> dict:
        rec: dict = {"batch": B, "context": C, "mode": "compiled" if compiled else "eager"}
        for attr in ("_cache", "_previous_max_cache_length"):   # a static cache sized by this point alone
            if hasattr(model, attr):
                try:
                    delattr(model, attr)
                except AttributeError:
                    pass
        ids = torch.randint(0, high, (B, C), generator=gen).to(dev)
        timer = StepTimer()
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=W + K + 1, do_sample=False,
                      cache_implementation="static", pad_token_id=pad, disable_compile=not compiled,
                      logits_processor=LogitsProcessorList([timer]))
        if chunking and B * C > 131072:      # bounds prefill activations next to the 34 GB static cache
            kwargs["prefill_chunk_size"] = max(128, 65536 // B)
            rec["prefill_chunk_size"] = kwargs["prefill_chunk_size"]
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        t = time.perf_counter()
        with torch.inference_mode():
            result = model.generate(ids, **kwargs)
        rec["generate_s"] = round(time.perf_counter() - t, 3)
        if result.shape[1] != C + W + K + 1:
            raise RuntimeError(f"generate returned {result.shape[1] - C} tokens, wanted {W + K + 1}")
        steps = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])][W:W + K]
        rec.update(median_s=statistics.median(steps), min_s=min(steps), max_s=max(steps), steps=len(steps),
                   warmup_steps=W, mean_context=C + W + (K + 1) / 2, kv_tokens_per_step=B * (C + W + (K + 1) / 2),
                   first_steps_s=[round(b - a, 4) for a, b in zip(timer.stamps, timer.stamps[1:])][:W])
        del result, ids
        return rec

    def run_points(mode: str, records: list, W: int) -> None:
        compiled = mode == "compiled"
        last_wall = None
        for B, C in _point_order(spec["batch_sizes"], spec["contexts"]):
            rec: dict = {"batch": B, "context": C, "mode": mode}
            estimate = 5 + B * C / (prefill_rate or 2000) * 1.5 + (W + K) * 0.2
            if compiled:
                # a new shape recompiles (dynamo's automatic dynamic shapes soon cover the rest);
                # a point cut off by the deadline loses only itself
                estimate = max(estimate, 0.5 * last_wall if last_wall else 45)
            if deadline.left() < estimate:
                rec["skipped"] = "time budget"
                records.append(rec)
                continue
            try:
                rec = decode_point(B, C, compiled, W)
                last_wall = rec["generate_s"]
                log(f"[transformers] decode ({mode}) B={B} C={C}: {rec['median_s'] * 1e3:.2f} ms/step "
                    f"(generate {rec['generate_s']:.1f} s)")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                rec["error"] = error_text(exc)
                if compiled:                      # a compile failure would repeat at every point
                    records.append(rec)
                    save()
                    return
            records.append(rec)
            save()

    run_points("eager", out["decode"], spec["warmup_steps"])
    if spec["hf_compile"] and cuda:
        import torch._dynamo
        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                     "accumulated_cache_size_limit"):
            try:
                setattr(torch._dynamo.config, name, max(256, int(getattr(torch._dynamo.config, name))))
            except (AttributeError, TypeError, ValueError):
                pass
        run_points("compiled", out["decode_compiled"], spec["compiled_warmup_steps"])
    else:
        out["compiled_skipped"] = "--quick" if cuda else "no compile on CPU"
    if cuda:
        out["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)


WORKERS = {"ceilings": worker_ceilings, "checkpoint": worker_checkpoint, "pdserve": worker_pdserve,
           "transformers": worker_transformers}


def worker_main(kind: str, in_path: str, out_path: str) -> int:
    spec = json.loads(Path(in_path).read_text())
    out: dict = {"worker": kind, "started": time.time()}

    def save() -> None:
        out["elapsed_s"] = round(time.time() - out["started"], 2)
        save_json(out_path, out)

    save()
    try:
        WORKERS[kind](spec, out, save)
        out["status"] = "ok"
        rc = 0
    except Exception as exc:  # noqa: BLE001 - the orchestrator records it
        traceback.print_exc()
        out["status"] = "error"
        out["error"] = error_text(exc)
        rc = 1
    save()
    return rc


# ======================================================================= orchestration

def run_phase(kind: str, spec: dict, deadline: float, label: str) -> dict:
    """Runs one worker subprocess until it ends or `deadline` (+ grace) passes; returns
    whatever it saved, with status/error set."""
    with tempfile.TemporaryDirectory(prefix="gpu-engine-") as tmp:
        in_path, out_path = Path(tmp) / "in.json", Path(tmp) / "out.json"
        in_path.write_text(json.dumps({**spec, "deadline": deadline}))
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
               "--worker-in", str(in_path), "--worker-out", str(out_path)]
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, start_new_session=True)
        killed = None
        try:
            proc.wait(timeout=max(1.0, deadline + KILL_GRACE_S - time.time()))
        except subprocess.TimeoutExpired:
            killed = "killed: past its time budget"
        except BaseException:
            killed = "interrupted"
            raise
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)   # the worker and its children (e.g. compile workers)
                except ProcessLookupError:
                    pass
                proc.wait()
        try:
            result = json.loads(out_path.read_text())
        except (OSError, ValueError):
            result = {}
    if killed:
        result["status"] = "killed"
        result["error"] = killed
    elif proc.returncode != 0 and result.get("status") != "error":
        result["status"] = "error"
        result.setdefault("error", f"{label} exited with status {proc.returncode}")
    result.setdefault("status", "ok")
    return result


def ceiling_values(results: dict) -> tuple[float | None, float | None]:
    c = results.get("ceilings", {})
    bw = c.get("copy", {}).get("bandwidth_bytes_per_s")
    mm = c.get("matmul", {}).get("flops_per_s")
    return bw, mm


def decode_rows(results: dict, systems: list[str], m: ModelMath) -> list[dict]:
    """Per (batch, context): the nominal floor, and per system the median step, its MBU
    (against the floor at the context that system actually attended to) and mode."""
    bw, _ = ceiling_values(results)
    plan = results["plan"]
    by_point: dict[tuple[int, int], dict] = {}
    for system in systems:
        r = results.get("systems", {}).get(system, {})
        recs = list(r.get("decode", []))
        if system == "transformers":     # the faster of eager / compiled at each point
            best: dict[tuple[int, int], dict] = {}
            for rec in recs + list(r.get("decode_compiled", [])):
                key = (rec["batch"], rec["context"])
                old = best.get(key)
                if old is None or ("median_s" in rec and ("median_s" not in old or rec["median_s"] < old["median_s"])):
                    best[key] = rec
            recs = list(best.values())
        for rec in recs:
            row = by_point.setdefault((rec["batch"], rec["context"]), {"batch": rec["batch"],
                                                                         "context": rec["context"]})
            cell: dict = {}
            if "median_s" in rec:
                cell["step_s"] = rec["median_s"]
                cell["tokens_per_s"] = rec["batch"] / rec["median_s"]
                if bw:
                    floor = m.decode_floor_s(rec["kv_tokens_per_step"], bw)
                    cell["floor_s"] = floor
                    cell["mbu"] = floor / rec["median_s"]
                if rec.get("mode"):
                    cell["mode"] = rec["mode"]
                if rec.get("runner_median_s"):
                    cell["runner_s"] = rec["runner_median_s"]
            else:
                cell["error"] = rec.get("error") or rec.get("skipped") or "no result"
            row[system] = cell
    for (b, c), row in by_point.items():
        if bw:   # the nominal floor: context C + W + (K + 1) / 2 on average over the timed steps
            mean_context = c + plan["warmup_steps"] + (plan["decode_steps"] + 1) / 2
            row["floor_s"] = m.decode_floor_s(b * mean_context, bw)
    return [by_point[k] for k in sorted(by_point)]


def prefill_rows(results: dict, systems: list[str], m: ModelMath) -> list[dict]:
    _, mm = ceiling_values(results)
    rows: dict[int, dict] = {}
    for system in systems:
        for rec in results.get("systems", {}).get(system, {}).get("prefill", []):
            P = rec["tokens"]
            row = rows.setdefault(P, {"tokens": P, "flops": m.prefill_flops(P)})
            cell: dict = {}
            if "median_s" in rec:
                cell.update(time_s=rec["median_s"], tokens_per_s=P / rec["median_s"])
                if mm:
                    cell["mfu"] = m.prefill_flops(P) / rec["median_s"] / mm
                if "first_token" in rec:
                    cell["first_token"] = rec["first_token"]
            else:
                cell["error"] = rec.get("error") or rec.get("skipped") or "no result"
            row[system] = cell
    return [rows[k] for k in sorted(rows)]


def target_rows(decode: list[dict], prefill: list[dict], systems: list[str]) -> list[dict]:
    out = []
    for kind, at, minimum in TARGETS:
        src = decode if kind == "decode_mbu" else prefill
        for row in src:
            if (row.get("batch") if kind == "decode_mbu" else row.get("tokens")) != at:
                continue
            label = (f"decode MBU, batch {at}, context {row['context']}" if kind == "decode_mbu"
                     else f"prefill MFU, {at} tokens")
            entry = {"target": label, "minimum": minimum, "values": {}}
            for s in systems:
                cell = row.get(s, {})
                v = cell.get("mbu" if kind == "decode_mbu" else "mfu")
                entry["values"][s] = None if v is None else {"value": v, "met": v >= minimum}
            out.append(entry)
    return out


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _err(cell: dict) -> str:
    text = cell.get("error", "")
    return "skipped" if text == "time budget" else f"error: {text[:60]}"


def format_decode_table(rows: list[dict], systems: list[str]) -> str:
    head = ["batch", "context", "floor ms"]
    for s in systems:
        head += [f"{s} ms/step", f"{s} MBU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        cells = [str(row["batch"]), str(row["context"]), _ms(row.get("floor_s"))]
        for s in systems:
            cell = row.get(s)
            if cell is None:
                cells += ["-", "-"]
            elif "error" in cell:
                cells += [_err(cell), "-"]
            else:
                mode = f" ({cell['mode']})" if s == "transformers" and cell.get("mode") else ""
                cells += [_ms(cell["step_s"]) + mode, _pct(cell.get("mbu"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_prefill_table(rows: list[dict], systems: list[str]) -> str:
    head = ["prompt tokens", "TFLOP"]
    for s in systems:
        head += [f"{s} ms", f"{s} tok/s", f"{s} MFU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        cells = [str(row["tokens"]), f"{row['flops'] / 1e12:.2f}"]
        for s in systems:
            cell = row.get(s)
            if cell is None:
                cells += ["-", "-", "-"]
            elif "error" in cell:
                cells += [_err(cell), "-", "-"]
            else:
                cells += [f"{cell['time_s'] * 1e3:.1f}", f"{cell['tokens_per_s']:,.0f}", _pct(cell.get("mfu"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_target_table(rows: list[dict], systems: list[str]) -> str:
    head = ["target", "minimum"] + systems
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * len(systems)]
    for row in rows:
        cells = [row["target"], _pct(row["minimum"])]
        for s in systems:
            v = row["values"].get(s)
            cells.append("-" if v is None else f"{_pct(v['value'])} {'met' if v['met'] else 'MISSED'}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_plan(args) -> dict:
    quick = args.quick
    cpu = args.device == "cpu"

    def ints(text: str | None, default: list[int]) -> list[int]:
        return [int(x) for x in text.split(",") if x] if text else default

    plan = {
        "batch_sizes": ints(args.batch_sizes, [1, 64] if quick else [1, 8, 32, 64, 128]),
        "contexts": ints(args.contexts, [512] if quick else [512, 2048]),
        "prefill_lens": ints(args.prefill_lens, [2048] if quick else [512, 1024, 2048, 4096]),
        "decode_steps": args.decode_steps or (8 if quick else 32),
        "warmup_steps": 2 if quick else 3,
        "compiled_warmup_steps": 6,
        "prefill_reps": 2 if quick else 3,
        "hf_compile": not quick and not args.no_compile,
    }
    if cpu:   # a tiny model on a CPU: keep the smoke test short
        plan.update(batch_sizes=ints(args.batch_sizes, [1, 4]), contexts=ints(args.contexts, [64]),
                    prefill_lens=ints(args.prefill_lens, [128]), decode_steps=args.decode_steps or 4,
                    warmup_steps=1, prefill_reps=1)
    plan["max_num_batched_tokens"] = max(8192, max(plan["prefill_lens"]))
    plan["num_kv_blocks"] = kv_blocks_needed(plan["batch_sizes"], plan["contexts"], plan["prefill_lens"],
                                             plan["max_num_batched_tokens"], plan["warmup_steps"],
                                             plan["decode_steps"])
    return plan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few points, short runs, no torch.compile (smoke test)")
    ap.add_argument("--systems", default="pdserve,pdserve-eager-old,transformers", help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--skip-transformers", action="store_true", help="drop transformers from --systems")
    ap.add_argument("--model-dir", default=None, help="checkpoint dir, written unless it already holds one "
                                                      "(default /tmp/llama3-8b-random)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu_engine.json"))
    ap.add_argument("--budget-s", type=float, default=440.0, help="wall-clock budget for the whole run")
    ap.add_argument("--batch-sizes", default=None, help="decode batch sizes (default 1,8,32,64,128)")
    ap.add_argument("--contexts", default=None, help="decode prompt lengths (default 512,2048)")
    ap.add_argument("--prefill-lens", default=None, help="prefill prompt lengths (default 512,1024,2048,4096)")
    ap.add_argument("--decode-steps", type=int, default=None, help="timed decode steps per point (default 32)")
    ap.add_argument("--no-compile", action="store_true", help="transformers: uncompiled static cache only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, choices=sorted(SHAPES), help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, choices=sorted(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--worker-in", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if args.worker:
        return worker_main(args.worker, args.worker_in, args.worker_out)

    started = time.time()
    end = started + args.budget_s
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown system(s) {bad}; choose from {', '.join(SYSTEMS)}")
    if args.skip_transformers:
        systems = [s for s in systems if s != "transformers"]
    shape_name = args.shape or ("tiny" if args.device == "cpu" else "llama3-8b")
    model_dir = args.model_dir or ("/tmp/llama3-8b-random" if shape_name == "llama3-8b"
                                   else f"/tmp/pdserve-{shape_name}-random")
    m = ModelMath.from_shape(SHAPES[shape_name])
    plan = build_plan(args)
    cpu = args.device == "cpu"
    base = dict(device=args.device, seed=args.seed, model_dir=model_dir, shape=shape_name,
                prompt_id_high=SHAPES[shape_name]["vocab_size"] - NUM_SPECIAL_TOKENS,
                drop_unknown_options=cpu, **plan)
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv))),
        "shape": shape_name, "model_dir": model_dir, "plan": plan, "systems_requested": systems,
        "model": {"parameters": m.parameters, "weight_bytes_per_decode_step": m.weight_bytes_per_step,
                  "kv_bytes_per_token": m.kv_bytes_per_token, "matmul_parameters": m.matmul_parameters},
        "phases": {}, "systems": {},
    }
    log(f"gpu_engine: {shape_name} model in {model_dir}; systems {', '.join(systems)}; budget {args.budget_s:.0f} s")
    log(f"  {m.parameters / 1e9:.2f} B parameters, {m.weight_bytes_per_step / 1e9:.2f} GB read per decode step "
        f"(embedding excluded), {m.kv_bytes_per_token / 1024:.0f} KiB KV per token, "
        f"{plan['num_kv_blocks']} KV blocks for pdserve")

    phases = ["ceilings", "checkpoint"] + systems

    # each phase may run until its cap, but leaves the later phases what they need to be
    # worth starting (scaled down when the whole budget is smaller than those needs)
    scale = min(1.0, args.budget_s / sum(PHASE_LIMITS[p][1] for p in phases))

    def phase_deadline(i: int) -> tuple[float, bool]:
        cap, need = PHASE_LIMITS[phases[i]]
        later = scale * sum(PHASE_LIMITS[p][1] for p in phases[i + 1:])
        deadline = min(time.time() + cap * (4 if cpu else 1), end - later)
        return deadline, deadline - time.time() >= scale * need / 2

    for i, phase in enumerate(phases):
        deadline, worth = phase_deadline(i)
        t0 = time.time()
        if not worth:
            res = {"status": "skipped", "error": "time budget"}
        else:
            log(f"\n== {phase} (deadline in {deadline - t0:.0f} s, {t0 - started:.0f} s elapsed)")
            if phase == "ceilings":
                spec = dict(base, copy_bytes=(256 << 20) if cpu else 4 * GIB, matmul_n=1024 if cpu else 8192)
                res = run_phase("ceilings", spec, deadline, phase)
            elif phase == "checkpoint":
                res = run_phase("checkpoint", base, deadline, phase)
            elif phase == "transformers":
                res = run_phase("transformers", base, deadline, phase)
            else:
                res = run_phase("pdserve", dict(base, system=phase), deadline, phase)
        res["phase_s"] = round(time.time() - t0, 1)
        results["phases"][phase] = {"seconds": res["phase_s"], "status": res.get("status"),
                                    "error": res.get("error")}
        if phase in SYSTEMS:
            results["systems"][phase] = res
        else:
            results[phase] = res
        log(f"== {phase}: {res.get('status')} in {res['phase_s']:.1f} s"
            + (f" ({res['error']})" if res.get("error") else ""))
        if phase == "checkpoint" and res.get("status") != "ok":
            log("no checkpoint: the systems cannot run")
            for s in systems:
                results["systems"][s] = {"status": "skipped", "error": "no checkpoint"}
                results["phases"][s] = {"seconds": 0, "status": "skipped", "error": "no checkpoint"}
            save_json(out_path, results)
            break
        save_json(out_path, results)

    decode = decode_rows(results, systems, m)
    prefill = prefill_rows(results, systems, m)
    targets = target_rows(decode, prefill, [s for s in systems if s != "transformers"] +
                          (["transformers"] if "transformers" in systems else []))
    results.update(decode_table=decode, prefill_table=prefill, targets=targets,
                   total_s=round(time.time() - started, 1))
    save_json(out_path, results)

    ceil = results.get("ceilings", {})
    bw, mm = ceiling_values(results)
    log("\n## Results\n")
    log(f"device: {ceil.get('device_name', '?')} ({ceil.get('memory_gib', '?')} GiB), torch {ceil.get('torch', '?')}, "
        f"triton {ceil.get('triton', '?')}, transformers {ceil.get('transformers', '?')}")
    copy_gib = ceil.get("copy", {}).get("bytes_copied", 0) / GIB
    mm_n = ceil.get("matmul", {}).get("n", "?")
    log(f"ceilings: copy bandwidth {'-' if bw is None else f'{bw / 1e12:.3f} TB/s'} ({copy_gib:g} GiB "
        f"device-to-device copy, read + write), bf16 matmul {'-' if mm is None else f'{mm / 1e12:.1f} TFLOP/s'} "
        f"({mm_n}^3)")
    log(f"model: Llama-3-8B shape ({shape_name}), random bf16 weights, {m.weight_bytes_per_step / 1e9:.2f} GB "
        f"of weights read per decode step, {m.kv_bytes_per_token:,} B of KV per token")
    cp = results.get("checkpoint", {})
    if cp.get("status") == "ok":
        log(f"checkpoint: {'reused' if cp.get('reused') else 'written'} in {cp.get('seconds', 0):.1f} s")
    hf = results["systems"].get("transformers", {})
    if hf.get("decode_compiled"):
        n_ok = sum("median_s" in r for r in hf["decode_compiled"])
        log(f"transformers: torch.compile'd generate ran at {n_ok} of {len(hf['decode_compiled'])} decode points; "
            "the table shows the faster mode per point")
    W, K = plan["warmup_steps"], plan["decode_steps"]
    log(f"\n### Decode step time (median of {K} steps after {W} warm-up; floor = weights + KV at the copy "
        f"bandwidth, context C + {W} + {K}/2 on average; MBU = floor / step)\n")
    log(format_decode_table(decode, systems))
    log(f"\n### Prefill (one prompt per step, median of {plan['prefill_reps']}; MFU against the measured "
        "matmul rate)\n")
    log(format_prefill_table(prefill, systems))
    log("\n### Targets\n")
    log(format_target_table(targets, [s for s in systems if s != "transformers"] +
                            (["transformers"] if "transformers" in systems else [])))
    sanity = {}
    for row in prefill:
        toks = {s: row[s]["first_token"] for s in systems if "first_token" in row.get(s, {})}
        if len(toks) > 1:
            sanity[row["tokens"]] = toks
    if sanity:
        agree = sum(len(set(t.values())) == 1 for t in sanity.values())
        log(f"\nsanity: the systems' first greedy token after the same prompt agrees at {agree} of "
            f"{len(sanity)} prompt lengths {sanity}")
        results["first_token_agreement"] = sanity
    log("\nphase times: " + ", ".join(f"{k} {v['seconds']:.0f} s ({v['status']})"
                                      for k, v in results["phases"].items())
        + f"; total {results['total_s']:.0f} s")
    save_json(out_path, results)
    log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
