"""The `pdserve` command.

    pdserve make-tiny-model DIR [--preset tiny] [--seed 0]
    pdserve generate [--model DIR] [--prompt TEXT ...] [--max-tokens N] [--temperature T] [--tp N] ...
    pdserve plan --model DIR|llama-3-70b --tp N [--gpu-memory-gib G] [--gpu-type T] [--json]
    pdserve serve [--config FILE] [--model DIR] [--port P] [--mode M] ...   (see serve_command.py)
    pdserve loadtest [--base-url URL] [--request-rate R | --sweep-rates R,...] [--goodput ttft:MS ...] ...
                                                                       (see bench/loadtest/cli.py)

Only this module (and the app builder) reads the command line, files and the
environment; it hands plain values to the engine.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from bench.loadtest.cli import add_loadtest_parser
from cluster.cli.plan_command import add_plan_parser
from cluster.cli.profile_command import add_profile_parser
from cluster.cli.serve_command import add_serve_parser
from cluster.cli.simulate_command import add_simulate_parser


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import PRESETS, make_tiny_model
    if args.preset not in PRESETS:
        print(f"error: unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    try:
        path = make_tiny_model(args.dir, args.preset, seed=args.seed, dtype=args.dtype, overwrite=args.overwrite)
    except OSError as exc:
        if exc.errno is None:      # one of make_tiny_model's own refusals, which say what to change
            raise
        print(f"error: cannot write a checkpoint to {args.dir} ({exc.strerror}: {exc.filename}): give a "
              "directory whose parent folder exists and can be written", file=sys.stderr)
        return 2
    print(f"wrote {args.preset} checkpoint to {path}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine import LLM, SamplingParams
    from engine.sampling_params import SamplingParamsError
    from engine.tiny_model import checkpoint_dir

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or None,
                                ignore_eos=args.ignore_eos)
        model = checkpoint_dir(args.model)
    except (SamplingParamsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    options = dict(dtype=args.dtype, device=args.device, tensor_parallel_size=args.tp)
    if args.max_model_len is not None:     # (0 is refused by the engine, not taken for "the model's")
        options["max_model_len"] = args.max_model_len
    with LLM(model, **options) as llm:
        return _generate(llm, args, params)


def _generate(llm, args: argparse.Namespace, params) -> int:
    from engine.errors import InvalidRequestError

    prompts = args.prompt or ["The quick brown fox", "Once upon a time", "def fibonacci(n):"]
    try:
        if args.stream:
            for prompt in prompts:
                print(f"--- {prompt!r}")
                print(prompt, end="", flush=True)
                for out in llm.stream(prompt, params):
                    print(out.delta_text, end="", flush=True)
                print()
            return 0
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    except InvalidRequestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, outputs):
        print(f"--- {prompt!r} -> {len(out.token_ids)} tokens, finish_reason={out.finish_reason}")
        print(prompt + out.text)
    total = sum(len(o.token_ids) for o in outputs)
    print(f"--- {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write a small deterministic HuggingFace checkpoint")
    p.add_argument("dir")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint this command made in DIR before (other directories are refused)")
    p.set_defaults(func=_cmd_make_tiny_model)

    p = sub.add_parser("generate", help="offline generation with the engine")
    p.add_argument("--model", default=None,
                   help="HuggingFace checkpoint directory, or a built-in model: tiny (the default), bench, ...")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, dest="tp",
                   help="shard the model over N local rank processes")
    p.set_defaults(func=_cmd_generate)

    add_plan_parser(sub)
    add_profile_parser(sub)
    add_simulate_parser(sub)
    add_serve_parser(sub)
    add_loadtest_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except SystemExit as exc:
        # ray.init's SIGTERM handler exits with the signal's number (15); a shell's and a
        # supervisor's convention, and `pdserve serve`'s own once it deploys, is 128 + it
        if exc.code == signal.SIGTERM:
            return 128 + signal.SIGTERM
        raise
    except (ValueError, OSError) as exc:    # a bad value, or a path it cannot read or write: said, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
