"""Measure an engine's step times over a grid of batch shapes and fit a
LinearStepModel to them (`pdserve profile`).

The grid covers the three kinds of step a worker runs:
- prefill-only: one prompt of each length, and a chunk after a cached prefix;
- decode-only: B sequences decoding at context C;
- mixed: B decodes next to one prompt chunk (chunked prefill in a colocated
  or conditional-disaggregation worker).
Every step the engine runs while the grid is driven is a data point: its
shape is read off the scheduled step, its time is the whole `LLMEngine.step`
(scheduling, forward, sampling, outputs), as a worker spends it.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from cluster.perf_model.linear_model import LinearStepModel
from cluster.perf_model.step_shape import StepShape, model_shape

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProfileGrid:
    prompt_lens: tuple[int, ...] = (16, 64, 256, 512)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (32, 256)
    chunk_len: int = 64                  # the prompt chunk of mixed steps, and of prefix-cached chunks
    decode_steps: int = 4                # decode steps measured per (batch, context)


@dataclass
class StepRecorder:
    """Wraps an engine's runner so that every step's shape is known."""
    engine: Any
    shapes: list[StepShape] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)

    def step(self, kind: str) -> list:
        captured: list[StepShape] = []
        runner = self.engine.runner
        launch = runner.launch

        def recording_launch(step, *args, **kwargs):
            captured.append(shape_of(step))
            return launch(step, *args, **kwargs)

        runner.launch = recording_launch
        try:
            started = time.perf_counter()
            outputs = self.engine.step()
            elapsed = time.perf_counter() - started
        finally:
            runner.launch = launch
        if captured and not captured[0].is_empty:
            self.shapes.append(captured[0])
            self.seconds.append(elapsed)
            self.kinds.append(kind)
        return outputs


def shape_of(step) -> StepShape:
    """The StepShape of an engine ScheduledStep (decodes first, then chunks)."""
    decodes = [seq.num_computed_tokens + 1 for seq in step.seqs[:step.num_decode_seqs]]
    chunks = [(seq.num_computed_tokens, n)
              for seq, n in zip(step.seqs[step.num_decode_seqs:], step.num_new_tokens[step.num_decode_seqs:])]
    return StepShape.build(chunks, decodes)


def profile_engine(engine, grid: ProfileGrid, *, seed: int = 0, warm_up_grid: bool = False,
                   progress: Callable[[str], None] | None = None) -> StepRecorder:
    """Drives `engine` (an idle LLMEngine) through the grid; returns the recorded steps.

    warm_up_grid: drive the whole grid once unrecorded first. On CUDA the first
    step of each new token count pays for loading the kernels cuBLAS picks for
    it (~100 ms for an 8B model on an H200), which would otherwise be fitted as
    step time."""
    from engine import SamplingParams
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len - 1
    budget = engine.scheduler.max_num_batched_tokens
    max_seqs = engine.scheduler.max_num_seqs

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def drain(kind: str) -> None:
        while engine.has_unfinished_requests():
            recorder.step(kind)

    longest = min(limit, budget)             # a prompt prefilled in one step
    prompt_lens = [p for p in grid.prompt_lens if p <= longest]
    contexts = [c for c in grid.contexts if c + grid.decode_steps + 2 <= limit]
    dropped = [f"prompt lengths {sorted(set(grid.prompt_lens) - set(prompt_lens))} (past {longest} tokens: the "
               "context less one, or the step budget)"] if len(prompt_lens) < len(grid.prompt_lens) else []
    if len(contexts) < len(grid.contexts):
        dropped.append(f"contexts {sorted(set(grid.contexts) - set(contexts))} (past "
                       f"{limit - grid.decode_steps - 2}: the context less the decode steps)")
    if dropped and prompt_lens and contexts:
        log.warning("profile: the grid's %s cannot run here and are left out; the fit extrapolates past what "
                    "it measured", " and ".join(dropped))
    if not prompt_lens or not contexts:
        raise ValueError(
            f"the grid has no {'prompt length' if not prompt_lens else 'context'} that fits: prompts must be "
            f"<= {longest} tokens (the context less one, and the step budget), contexts <= "
            f"{limit - grid.decode_steps - 2} (the context less the decode steps); lower --prompt-lens / "
            "--contexts or raise --max-model-len / --max-num-batched-tokens")

    # warm-up, not recorded: the first steps pay for allocations, kernel selection, caches
    recorder = StepRecorder(engine)
    for n in (min(prompt_lens), max(prompt_lens)):
        engine.add_request(None, prompt(n), params(4))
        drain("warm-up")

    def drive_grid(label: str) -> None:
        # prefill-only: one fresh prompt per step; then a chunk after that prompt's cached blocks
        for n in prompt_lens:
            engine.add_request(None, prompt(n), params(1))
            drain("prefill")
        chunk = min(grid.chunk_len, longest // 2)
        shared = prompt(min(limit - chunk, max(grid.prompt_lens)))
        for tail in (chunk, chunk // 2):
            engine.add_request(None, shared + prompt(tail), params(1))
            drain("prefill")
        # decode-only, then mixed: B sequences at context C, then one chunk arrives beside them
        for batch in (b for b in grid.batch_sizes if b <= max_seqs - 1):
            for context in contexts:
                if progress:
                    progress(f"{label}batch {batch}, context {context}")
                ids = [engine.add_request(None, prompt(context), params(grid.decode_steps + 3))
                       for _ in range(batch)]
                started: set[str] = set()
                while len(started) < len(ids):
                    started.update(o.request_id for o in recorder.step("prefill"))
                for _ in range(grid.decode_steps):
                    recorder.step("decode")
                engine.add_request(None, prompt(min(chunk, budget - batch)), params(1))
                recorder.step("mixed")
                drain("decode")

    if warm_up_grid:
        drive_grid("warm-up pass: ")
    recorder = StepRecorder(engine)
    drive_grid("")
    return recorder


def run_profile(model: str, *, tp: int = 1, device: str = "auto", dtype: str = "auto",
                grid: ProfileGrid = ProfileGrid(), engine_options: dict[str, Any] | None = None,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Builds an engine, profiles it, fits the model; returns the profile JSON
    (the fitted model plus every raw point)."""
    from engine import EngineConfig, LLMEngine
    # one step at a time: with async scheduling a step() call would also read back the previous step
    options = {"max_num_seqs": max(grid.batch_sizes) + 1, **(engine_options or {}), "async_scheduling": False}
    engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tp, device=device, dtype=dtype, **options))
    try:
        engine.step()     # nothing queued: a no-op, but fails early on a broken engine
        on_gpu = engine.worker.device.type == "cuda"
        recorder = profile_engine(engine, grid, warm_up_grid=on_gpu, progress=progress)
        meta = {"model": str(model), "model_shape": model_shape(engine.model_config), "tp": tp,
                "device": str(engine.worker.device),
                "dtype": str(engine.worker.dtype).removeprefix("torch."),
                "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
                "threads": getattr(engine.worker, "num_threads", None), "warm_up_grid": on_gpu}
        fitted = LinearStepModel.fit(recorder.shapes, recorder.seconds, meta, eager_floor=on_gpu)
    finally:
        engine.shutdown()
    result = fitted.to_json()
    result["points"] = [{"kind": k, **vars_of(s), "seconds": t, "predicted": fitted.step_time(s)}
                        for k, s, t in zip(recorder.kinds, recorder.shapes, recorder.seconds)]
    return result


def vars_of(shape: StepShape) -> dict[str, Any]:
    return {name: getattr(shape, name) for name in shape.__slots__}
