"""Which steps replay a captured decode graph: decode-only steps whose every row
is sampled. A prompt chunked down to one token (the step's budget ran out) looks
like a decode but takes no sample, and the graph returns a logits row per token."""

from __future__ import annotations

from types import SimpleNamespace

from engine.block_manager import BlockManager
from engine.cuda_graphs import DecodeGraphs
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def _steps(prompts: list[list[int]], num_steps: int) -> list[tuple[bool, int, int, bool]]:
    """(decode-only, tokens, rows sampled, graph replayed) of the first steps of `prompts`."""
    block_size = 4
    scheduler = Scheduler(BlockManager(256, block_size), max_num_seqs=8, max_num_batched_tokens=4)
    worker = SimpleNamespace(kv_cache=SimpleNamespace(spec=SimpleNamespace(block_size=block_size)),
                             attention_backend="triton", decode_splits=lambda batch, length: 1)
    runner = ModelRunner(worker, Sampler())
    graphs = SimpleNamespace(sizes=[1, 2, 4, 8])       # what can_run reads of a captured DecodeGraphs
    for i, prompt in enumerate(prompts):
        scheduler.add(Sequence(str(i), prompt, len(prompt), SamplingParams(max_tokens=50)))
    seen = []
    for _ in range(num_steps):
        step = scheduler.schedule()
        inputs, sampled, _, _ = runner.prepare(step)
        seen.append((inputs.is_decode_only, inputs.input_ids.shape[0], len(sampled),
                     DecodeGraphs.can_run(graphs, inputs)))
        scheduler.after_step(step)
        for seq in sampled:
            seq.token_ids.append(5)
    return seen


def test_a_one_token_prompt_chunk_beside_decodes_runs_eagerly():
    # a budget of 4: three decodes and one token of the long prompt per step
    seen = _steps([[1], [1], [1], list(range(100, 140))], 3)
    assert seen == [(False, 4, 3, False), (True, 4, 3, False), (True, 4, 3, False)]


def test_a_decode_step_replays_its_graph():
    assert _steps([[1], [1], [1]], 2) == [(False, 3, 3, False), (True, 3, 3, True)]
