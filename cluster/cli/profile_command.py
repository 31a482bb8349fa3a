"""`pdserve profile`: measure the engine's step time over a grid of batch shapes
and write the fitted performance model (cluster/perf_model) with its raw points.

    pdserve profile --model DIR [--tp N] [--device D] [--dtype T] --output PROFILE.json

The simulator (`pdserve simulate --profile`) and the planner (`pdserve plan
--profile`) read the file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster.cli.output_file import output_problem, write_output


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive(text: str) -> int:
    (value,) = _ints(text)
    return value


def _grid_problem(args: argparse.Namespace) -> str | None:
    """What makes the flags unusable, before the engine is built and measured."""
    if args.max_num_batched_tokens <= max(args.batch_sizes):
        return (f"--max-num-batched-tokens ({args.max_num_batched_tokens}) must exceed the largest of "
                f"--batch-sizes ({max(args.batch_sizes)}): a mixed step holds the batch's decodes and a "
                "prompt chunk")
    if problem := output_problem(Path(args.output)):    # before the profile, not after
        return f"--output {args.output} cannot be written: {problem}"
    return None


def _cmd_profile(args: argparse.Namespace) -> int:
    from cluster.cli.plan_command import resolve_model_dir
    from cluster.perf_model.profiler import ProfileGrid, run_profile
    from engine.tiny_model import ensure_default_model

    if problem := _grid_problem(args):
        print(f"error: {problem}", file=sys.stderr)
        return 2

    model = str(ensure_default_model()) if args.model is None else str(resolve_model_dir(args.model))
    grid = ProfileGrid(prompt_lens=args.prompt_lens, batch_sizes=args.batch_sizes, contexts=args.contexts,
                       chunk_len=args.chunk_len, decode_steps=args.decode_steps)
    options = {"max_num_batched_tokens": args.max_num_batched_tokens}
    if args.max_model_len is not None:     # (0 is refused by the engine, not taken for "the model's")
        options["max_model_len"] = args.max_model_len
    try:
        result = run_profile(model, tp=args.tp, device=args.device, dtype=args.dtype, grid=grid,
                             engine_options=options, progress=lambda m: print(f"  {m}", file=sys.stderr))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_output(Path(args.output), json.dumps(result, indent=2) + "\n")
    err = result["fit_error"]
    print(f"{len(result['points'])} steps measured; fit error mean {err['mean_abs_rel']:.1%}, "
          f"max {err['max_abs_rel']:.1%}")
    for name, value in result["coefficients"].items():
        print(f"  {name:26s} {value:.3e}")
    if result["eager_floor_s"]:
        print(f"  {'eager_floor_s':26s} {result['eager_floor_s']:.3e}  (the least a step with prompt tokens takes)")
    print(f"wrote {args.output}")
    return 0


def add_profile_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure step times over batch shapes; write a performance model")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--output", required=True, help="where to write the profile JSON")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's")
    p.add_argument("--max-num-batched-tokens", type=_positive, default=2048,
                   help="per-step token budget (default 2048)")
    p.add_argument("--prompt-lens", type=_ints, default=(16, 64, 256, 512),
                   help="prefill-only prompt lengths (default 16,64,256,512)")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 4, 16), help="decode batch sizes (default 1,4,16)")
    p.add_argument("--contexts", type=_ints, default=(32, 256), help="decode contexts (default 32,256)")
    p.add_argument("--chunk-len", type=_positive, default=64, help="prompt chunk of mixed steps (default 64)")
    p.add_argument("--decode-steps", type=_positive, default=4, help="decode steps per batch/context (default 4)")
    p.set_defaults(func=_cmd_profile)
    return p
