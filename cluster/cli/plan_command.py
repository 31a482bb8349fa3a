"""`pdserve plan`: will a model fit, and how much KV cache is left; with
--slo, which configuration serves a workload best (cluster/cli/plan_goodput.py).

    pdserve plan --model DIR --tp N [--role colocated|prefill|decode] [--gpu-memory-gib G]
                 [--gpu-memory-utilization F] [--dtype D] [--max-model-len L] [--gpu-type T]
                 [--overhead-gib O] [--kv-transfer-staging-mib M] [--json]
    pdserve plan --model DIR --slo ttft:MS tpot:MS --gpus N [--gpu-type T] [workload flags] [--write-config F]

Reads only the checkpoint's config.json, so it runs anywhere, without weights
or a GPU. A prefill or decode replica (`--role`) leaves `--kv-transfer-staging-mib`
per rank free for its KV hand-off buffers, as the engines do (the deployment
file's kv_transfer.staging_mib); a colocated one hands nothing off. `--model`
is a checkpoint directory, or the name of a directory under configs/models/ of
this repository (llama-3-8b, llama-3-70b), found relative to this file; a
directory of that name in the working directory wins.

Exit status: 0 when the model fits, 1 when it does not (the plan, its problems
and what would fit are printed either way), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"


def known_models() -> list[str]:
    """Names `--model` accepts as shortcuts for configs/models/NAME."""
    if not MODELS_DIR.is_dir():
        return []
    return sorted(p.name for p in MODELS_DIR.iterdir() if (p / "config.json").is_file())


def resolve_model_dir(model: str) -> Path:
    """A checkpoint directory as given; else a name of configs/models/ (a config.json
    to plan with), or of a built-in model (tiny, bench, ...: built on first use)."""
    from engine.tiny_model import PRESETS, ensure_preset_model
    path = Path(model)
    if (path / "config.json").is_file():
        return path
    if model in known_models():
        return MODELS_DIR / model
    if model in PRESETS:
        return ensure_preset_model(model)
    return path


def _cmd_plan(args: argparse.Namespace) -> int:
    from engine.memory_planner import format_plan, plan, resolve_gpu_type
    from engine.model.model_config import ModelConfig, ModelConfigError

    try:
        gpu = resolve_gpu_type(args.gpu_type)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = resolve_model_dir(args.model)
    try:
        model = ModelConfig.from_pretrained(model_dir)
    except (ModelConfigError, OSError) as exc:
        from engine.tiny_model import PRESETS
        names = ", ".join([*known_models(), *PRESETS])
        print(f"error: --model {args.model}: {exc} (built-in names: {names})", file=sys.stderr)
        return 2
    if args.slo:
        from cluster.cli.plan_goodput import run_goodput_plan
        fixed_only = [flag for flag, given in (("--tp", args.tp is not None), ("--role", args.role != "colocated"),
                                               ("--kv-transfer-staging-mib", args.kv_transfer_staging_mib != 1024))
                      if given]
        if fixed_only:
            print(f"error: {', '.join(fixed_only)} plan one given replica; with --slo the search chooses the "
                  "roles and TP degrees itself: drop them, or drop --slo", file=sys.stderr)
            return 2
        return run_goodput_plan(args, model_dir, model)
    search_only = [f"--{dest.replace('_', '-')}" for dest, default in args.goodput_defaults.items()
                   if getattr(args, dest) != default]
    if search_only:
        print(f"error: {', '.join(search_only)} set the goodput search, which runs only with --slo: add --slo "
              "and --gpus, or drop them", file=sys.stderr)
        return 2
    if args.kv_transfer_staging_mib < 0:
        print(f"error: --kv-transfer-staging-mib must be >= 0, got {args.kv_transfer_staging_mib:g}", file=sys.stderr)
        return 2
    if args.tp is None:
        print("error: --tp is required (or give --slo and --gpus to search for the best configuration)",
              file=sys.stderr)
        return 2
    try:
        result = plan(model, tp=args.tp,
                      gpu_memory_gib=gpu.memory_gib if args.gpu_memory_gib is None else args.gpu_memory_gib,
                      gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype,
                      max_model_len=args.max_model_len, gpu_type=gpu.name, overhead_gib=args.overhead_gib,
                      kv_transfer_staging_gib=0.0 if args.role == "colocated" else args.kv_transfer_staging_mib / 1024)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
    else:
        print(format_plan(result))
    return 0 if result.fits else 1


def finite_float(text: str) -> float:
    """An argparse type: a float that is a number (not inf or nan, which no size or share is)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def add_plan_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Registers `plan` on a `pdserve` subparsers object; returns its parser."""
    p = subparsers.add_parser("plan", help="weights, KV cache capacity and decode floor per GPU, from config.json")
    p.add_argument("--model", required=True,
                   help="checkpoint directory with a config.json, or a name under configs/models/ "
                        "(llama-3-8b, llama-3-70b)")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (GPUs) per replica")
    p.add_argument("--gpu-memory-gib", type=finite_float, default=None,
                   help="memory per GPU in GiB (default: the --gpu-type's)")
    p.add_argument("--gpu-memory-utilization", type=finite_float, default=0.9,
                   help="fraction of GPU memory the engine may use (default 0.9)")
    p.add_argument("--dtype", default="auto",
                   help="auto (the checkpoint's; float32 runs as bfloat16), float32, float16, bfloat16")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence in tokens (default: the model's max_position_embeddings)")
    p.add_argument("--gpu-type", default="H100-SXM", help="H100-SXM (h100), H200 (h200) or A100-80GB (a100)")
    p.add_argument("--overhead-gib", type=finite_float, default=1.0,
                   help="per-GPU memory for activations, CUDA context and workspace (default 1.0)")
    p.add_argument("--role", choices=("colocated", "prefill", "decode"), default="colocated",
                   help="the replica's role: a prefill or decode replica leaves --kv-transfer-staging-mib free "
                        "per rank for KV hand-off buffers (default colocated)")
    p.add_argument("--kv-transfer-staging-mib", type=finite_float, default=1024.0,
                   help="per rank, with --role prefill or decode (the deployment's kv_transfer.staging_mib; "
                        "default 1024)")
    p.add_argument("--json", action="store_true", help="print every number of the plan as JSON")
    from cluster.cli.plan_goodput import add_goodput_arguments
    add_goodput_arguments(p)
    p.set_defaults(func=_cmd_plan)
    return p
