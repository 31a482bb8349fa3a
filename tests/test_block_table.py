"""BlockTable keeps its int32 array equal to its list, and the runner's step
inputs built from those arrays are the block tables and slots of the lists."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest

from engine.block_manager import BlockManager
from engine.block_table import BlockTable
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledStep
from engine.sequence import Sequence, SequenceStatus


def test_the_array_follows_appends_extends_growth_and_clear():
    table = BlockTable([5, 9])
    for block_id in range(100, 140):          # past the initial capacity, twice
        table.append(block_id)
    table.extend([7, 3])
    assert table.ids.tolist() == list(table) == [5, 9, *range(100, 140), 7, 3]
    assert table.ids.dtype == np.int32
    table.clear()
    assert len(table.ids) == 0
    table.extend([42])
    table.append(43)
    assert table.ids.tolist() == [42, 43]


@pytest.mark.parametrize("change", [
    lambda t: t.__setitem__(0, 1), lambda t: t.__delitem__(0), lambda t: t.pop(), lambda t: t.insert(0, 1),
    lambda t: t.remove(1), lambda t: t.sort(), lambda t: t.reverse(), lambda t: t.__iadd__([1]),
])
def test_other_list_changes_are_refused(change):
    table = BlockTable([1, 2])
    with pytest.raises(TypeError, match="append, extend and clear"):
        change(table)
    assert table.ids.tolist() == [1, 2]


def test_a_pickled_table_keeps_both_views():
    table = pickle.loads(pickle.dumps(BlockTable([4, 8, 15])))
    assert isinstance(table, BlockTable) and table.ids.tolist() == [4, 8, 15]


def _runner(backend: str, block_size: int) -> ModelRunner:
    worker = SimpleNamespace(kv_cache=SimpleNamespace(spec=SimpleNamespace(block_size=block_size)),
                             attention_backend=backend, decode_splits=lambda batch, length: 1)
    return ModelRunner(worker, Sampler())


def _running(request_id: str, num_tokens: int, num_computed: int) -> Sequence:
    return Sequence(request_id, [(3 * num_tokens + t) % 97 for t in range(num_tokens)], 1,
                    SamplingParams(max_tokens=8), status=SequenceStatus.RUNNING, num_computed_tokens=num_computed)


@pytest.mark.parametrize("backend", ["triton", "cpp"])
def test_step_inputs_read_the_current_blocks_after_a_sequence_is_freed_and_refilled(backend):
    bs = 4
    manager = BlockManager(64, bs, enable_prefix_caching=False)
    long_decode, short_decode, prompt = _running("a", 11, 10), _running("b", 3, 2), _running("c", 9, 2)
    for seq in (long_decode, short_decode, prompt):
        assert manager.allocate(seq.block_table, seq.num_tokens)
    # preempted and given blocks again: the table is cleared and refilled with other ids
    manager.free(short_decode.block_table)
    assert manager.allocate(prompt.block_table, 16)            # the prompt takes the freed blocks
    assert manager.allocate(short_decode.block_table, 3)
    step = ScheduledStep([short_decode, long_decode, prompt], [1, 1, 7], num_decode_seqs=2)
    inputs, sampled, pending, _ = _runner(backend, bs).prepare(step)

    def slot(seq, p):
        return list(seq.block_table)[p // bs] * bs + p % bs

    # decodes shortest first, then the prompt chunk of positions 2..8
    assert inputs.input_ids.tolist() == [short_decode.token_ids[2], long_decode.token_ids[10],
                                         *prompt.token_ids[2:9]]
    assert inputs.positions.tolist() == [2, 10, *range(2, 9)]
    assert inputs.meta.slot_mapping.tolist() == [slot(short_decode, 2), slot(long_decode, 10),
                                                 *(slot(prompt, p) for p in range(2, 9))]
    assert [s.request_id for s in sampled] == ["b", "a", "c"] and pending == []
    if backend == "triton":
        tables = inputs.meta.paged.block_tables.tolist()
        assert tables == [list(short_decode.block_table) + [0, 0], list(long_decode.block_table),
                          list(prompt.block_table)[:3]]
    else:
        group, = inputs.meta.decode_groups
        assert group.block_tables.tolist() == [list(short_decode.block_table) + [0, 0],
                                               list(long_decode.block_table)]
        assert group.seq_lens.tolist() == [3, 11]
