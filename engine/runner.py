"""One engine step on one device: build the flat batch, run the model, sample.

Input: a ScheduledStep (decodes first, then prefill chunks). Output: one sampled
token per sequence whose last uncomputed token ran in this step (decodes, and
prefills that reached the end of their tokens); chunks that stop mid-prompt
produce nothing.

With async scheduling a launched step's samples stay on the device until the
engine asks for them (`LaunchedStep.result`), so the host can schedule and
launch the next step meanwhile. A decode whose input token is still pending
(sampled by the previous launched step) gets it on the device: the runner
copies it from that step's sampled ids into the batch before the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.bad_words import banned_next
from engine.model.attention_metadata import (
    AttentionMetadata,
    DecodeGroup,
    PagedBatch,
    PrefillChunk,
    lone_fresh_prompt_takes_sdpa,
    to_device,
)
from engine.model_worker import STEP, ModelInputs, ModelWorker, TokenFill
from engine.sampler import Sampler, SampleResult, SamplingRow, TokenLogprobs
from engine.scheduler import ScheduledStep
from engine.sequence import Sequence


@dataclass(slots=True)
class ScoreSpan:
    """Prompt tokens [first, first + count) of `seq` scored in a step (prompt_logprobs)."""
    seq: Sequence
    first: int
    count: int


@dataclass(slots=True)
class LaunchedStep:
    """A step queued on the device. `sampled[i]` gets token row i of `token_ids`."""
    step: ScheduledStep
    sampled: list[Sequence]
    # each span's prompt logprobs, read back at launch (such a step is never overlapped)
    prompt_logprobs: list[tuple[ScoreSpan, list[TokenLogprobs]]] = field(default_factory=list)
    token_ids: torch.Tensor | None = None        # [S] int64 on the device
    overlapped: bool = False                     # the samples are read back in `result`
    _host_ids: torch.Tensor | None = None        # pinned copy of token_ids, filled by the device
    _ready: torch.cuda.Event | None = None       # recorded after that copy
    _result: SampleResult | None = None

    def result(self) -> SampleResult | None:
        """The samples (None when nothing was sampled); waits for the device if it must."""
        if self._result is None and self.overlapped:
            if self._ready is not None:
                self._ready.synchronize()
            ids = self._host_ids.tolist()
            self._result = SampleResult(token_ids=ids, logprobs=[None] * len(ids))
        return self._result


class ModelRunner:
    """Rank 0's step: prepare inputs (on CPU), send them to the other ranks,
    run this rank's shard, sample from the gathered logits."""

    def __init__(self, worker: ModelWorker, sampler: Sampler):
        self.worker = worker
        self.block_size = worker.kv_cache.spec.block_size
        self.sampler = sampler
        self.paged = worker.attention_backend == "triton"
        self.cpp_decode = worker.attention_backend == "cpp"

    def prepare(self, step: ScheduledStep) -> tuple[ModelInputs, list[Sequence], list[tuple[int, Sequence]],
                                                    list[ScoreSpan]]:
        """The step's model inputs, the sequences sampled (in logits row order), the
        (token row, sequence) of each decode whose input token is pending, and the
        prompt tokens scored (in score row order)."""
        bs = self.block_size
        # decodes (one new token after a cached context) first, shortest context first,
        # so that neighbours have similar lengths and can share a padded gather
        work = list(zip(step.seqs, step.num_new_tokens))
        decodes = sorted(((s, n) for s, n in work if n == 1 and s.num_computed_tokens > 0),
                         key=lambda sn: sn[0].num_computed_tokens)
        prefills = [(s, n) for s, n in work if not (n == 1 and s.num_computed_tokens > 0)]
        ids: list[int] = []
        positions: list[np.ndarray] = []       # decodes' as one array, then each prefill chunk's
        slots: list[np.ndarray] = []           # the same order
        decode_positions: list[int] = []
        decode_slots: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        decode_tables: list[np.ndarray] = []   # [used blocks] int32 views of each sequence's BlockTable
        prefill_tables: list[np.ndarray] = []
        chunks: list[PrefillChunk] = []
        pending: list[tuple[int, Sequence]] = []
        score_rows: list[np.ndarray] = []
        spans: list[ScoreSpan] = []

        def score(seq: Sequence, start: int, end: int, token_start: int) -> None:
            """Scores the prompt tokens a chunk over positions [start, end), whose first
            token is row `token_start`, predicts (the row of position p predicts p + 1)."""
            if seq.prompt_logprobs is not None and (span := _score_span(seq, start, end)) is not None:
                first_row = token_start + span.first - 1 - start
                score_rows.append(np.arange(first_row, first_row + span.count))
                spans.append(span)
        for seq, n in decodes:
            p = seq.num_computed_tokens
            if seq.num_pending_tokens:
                if seq.num_pending_tokens != 1:
                    raise RuntimeError(f"request {seq.request_id}: only a decode's one input token may be pending")
                pending.append((len(ids), seq))
            ids.append(seq.token_ids[p])
            decode_positions.append(p)
            decode_slots.append(seq.block_table[p // bs] * bs + p % bs)
            decode_tables.append(seq.block_table.ids[:p // bs + 1])
            score(seq, p, p + 1, len(ids) - 1)    # a prompt chunked down to one token (mid-prompt)
            if p + 1 == seq.num_tokens:       # else the last token of a prompt chunked down to one
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        positions.append(np.array(decode_positions, dtype=np.int64))
        slots.append(np.array(decode_slots, dtype=np.int64))
        for seq, n in prefills:
            start = seq.num_computed_tokens
            end = start + n
            token_start = len(ids)
            if seq.num_pending_tokens:
                raise RuntimeError(f"request {seq.request_id}: only a decode's one input token may be pending")
            ids.extend(seq.token_ids[start:end])
            chunk_positions = np.arange(start, end, dtype=np.int64)
            used = seq.block_table.ids[:-(-end // bs)]
            positions.append(chunk_positions)
            slots.append(used[chunk_positions // bs].astype(np.int64) * bs + chunk_positions % bs)
            # the torch path gathers a cached prefix through this table; the paged path reads `tables`
            prefix_table = used if start > 0 and not self.paged else used[:0]
            chunks.append(PrefillChunk(token_start, n, end, torch.from_numpy(prefix_table.astype(np.int64))))
            prefill_tables.append(used)
            score(seq, start, end, token_start)
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        slot_mapping = torch.from_numpy(np.concatenate(slots))
        lens = [p + 1 for p in decode_positions]
        if self.paged:
            meta = AttentionMetadata(slot_mapping, [], chunks,
                                     self._paged_batch(decode_tables + prefill_tables, lens, chunks))
        else:
            meta = AttentionMetadata(
                slot_mapping=slot_mapping,
                decode_groups=self._decode_groups(decode_tables, lens),
                prefills=chunks,
            )
        inputs = ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.from_numpy(np.concatenate(positions)),
            meta=meta,
            sample_indices=torch.tensor(sample_rows, dtype=torch.long),
        )
        if spans:
            inputs.score_rows = torch.from_numpy(np.concatenate(score_rows))
            inputs.score_targets = torch.tensor([t for span in spans
                                                 for t in span.seq.token_ids[span.first:span.first + span.count]])
            inputs.score_top_n = max(span.seq.params.prompt_logprobs for span in spans)
        return inputs, sampled, pending, spans

    def _paged_batch(self, tables: list[np.ndarray], decode_lens: list[int],
                     chunks: list[PrefillChunk]) -> PagedBatch:
        """Decodes then prefill chunks (`tables`: their used blocks, in that order),
        as block tables and lengths for the paged kernels."""
        num_decodes = len(decode_lens)
        lens = decode_lens + [c.context_len for c in chunks]
        block_tables = torch.from_numpy(_padded(tables, np.int32))
        query_start = [0]
        for c in chunks:
            query_start.append(query_start[-1] + c.num_tokens)
        return PagedBatch(
            num_decodes=num_decodes, block_tables=block_tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            prefill_query_start=torch.tensor(query_start, dtype=torch.int32),
            max_prefill_query_len=max((c.num_tokens for c in chunks), default=0),
            decode_splits=self.worker.decode_splits(num_decodes, max(decode_lens, default=1)),
            single_fresh_prefill=(num_decodes == 0 and len(chunks) == 1 and not chunks[0].has_cached_prefix
                                  and lone_fresh_prompt_takes_sdpa(chunks[0].num_tokens)))

    def _decode_groups(self, tables: list[np.ndarray], lens: list[int]) -> list[DecodeGroup]:
        """Splits decodes (sorted by length) where padding to the group's longest
        would waste more than a quarter of the gathered keys. The C++ kernel
        gathers nothing: one group, with each sequence's length."""
        if self.cpp_decode:
            if not tables:
                return []
            return [DecodeGroup(0, torch.from_numpy(_padded(tables, np.int64)), None,
                                torch.tensor(lens, dtype=torch.long))]
        groups = []
        start = 0
        while start < len(tables):
            end, total = start + 1, len(tables[start])
            while end < len(tables) and (end + 1 - start) * len(tables[end]) <= 1.25 * (total + len(tables[end])):
                total += len(tables[end])
                end += 1
            groups.append(self._decode_group(start, tables[start:end], lens[start:end]))
            start = end
        return groups

    def _decode_group(self, token_start: int, tables: list[np.ndarray], lens: list[int]) -> DecodeGroup:
        bs = self.block_size
        max_blocks = len(tables[-1])
        padded = torch.from_numpy(_padded(tables, np.int64))
        mask = None
        if any(n != max_blocks * bs for n in lens):
            mask = (torch.arange(max_blocks * bs)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]
        return DecodeGroup(token_start, padded, mask)

    def launch(self, step: ScheduledStep, previous: LaunchedStep | None = None,
               overlap: bool = False) -> LaunchedStep:
        """Queues the step on every rank and samples. With `overlap`, a step whose
        rows need nothing from the host to sample (no logprobs, no penalties)
        leaves its samples on the device for `result()`; otherwise they are read
        here. `previous`: the launched step whose samples are the pending input
        tokens of this one (overlapped and not yet resolved)."""
        inputs, sampled, pending, spans = self.prepare(step)
        fill = None
        if pending:
            if previous is None or previous.token_ids is None:
                raise RuntimeError("a step has pending input tokens but no launched step to take them from")
            row_of = {seq.request_id: i for i, seq in enumerate(previous.sampled)}
            src = to_device(torch.tensor([row_of[seq.request_id] for _, seq in pending]), previous.token_ids.device)
            fill = TokenFill(torch.tensor([row for row, _ in pending], dtype=torch.long), previous.token_ids[src])
        tp = self.worker.tp
        if tp.size > 1:
            tp.broadcast_object((STEP, inputs))
        forward = self.worker.execute(inputs, fill)
        logits = forward.logits
        launched = LaunchedStep(step, sampled)
        if spans:
            launched.prompt_logprobs = _split_scores(spans, forward.prompt_scores)
        if not sampled:
            return launched
        rows = [sampling_row(seq) for seq in sampled]
        if not (overlap and not spans and all(row.reads_nothing_from_host for row in rows)):
            launched._result = self.sampler(logits, rows)
            return launched
        launched.overlapped = True
        launched.token_ids = self.sampler.sample(logits, rows)
        launched._host_ids, launched._ready = _copy_to_host_async(launched.token_ids)
        return launched


def _score_span(seq: Sequence, start: int, end: int) -> ScoreSpan | None:
    """The prompt tokens a chunk over positions [start, end) scores that `seq` has
    no logprobs for yet (after a preemption the chunks run again; their tokens are
    scored once). None when there are none."""
    if start + 1 >= seq.num_prompt_tokens:
        return None        # past the prompt: a preempted request recomputing its output
    have = len(seq.prompt_logprobs)
    if have < start + 1:
        raise RuntimeError(f"request {seq.request_id}: prompt tokens up to {start} ran without their logprobs "
                           f"({have} scored); a request scoring its prompt must not skip any of it")
    first, stop = max(have, start + 1), min(end + 1, seq.num_prompt_tokens)
    return ScoreSpan(seq, first, stop - first) if stop > first else None


def _split_scores(spans: list[ScoreSpan], scores) -> list[tuple[ScoreSpan, list[TokenLogprobs]]]:
    """Each span's share of the step's score rows, with its own number of alternatives."""
    out, row = [], 0
    for span in spans:
        entries = scores.entries([span.seq.params.prompt_logprobs] * span.count, start=row)
        out.append((span, entries))
        row += span.count
    return out


def _copy_to_host_async(ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A host copy of `ids` that the device fills after the work queued so far,
    and the event to wait on before reading it (None on a CPU: already there)."""
    if ids.device.type != "cuda":
        return ids, None
    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def _padded(tables: list[np.ndarray], dtype: type) -> np.ndarray:
    """[n, longest] block tables of `dtype`, rows padded with block 0; at least one column."""
    width = max((len(t) for t in tables), default=0) or 1
    out = np.zeros((len(tables), width), dtype=dtype)
    for row, table in zip(out, tables):
        row[:len(table)] = table
    return out


def sampling_row(seq: Sequence) -> SamplingRow:
    """The sampler's view of a sequence. Until min_tokens are out, EOS and the
    stop token ids are banned so the sequence cannot end early; so is any token
    that would complete a bad word. The token histories are copied only for the
    penalties that read them."""
    params = seq.params
    banned: list[int] = []
    if seq.num_output_tokens < params.min_tokens:
        banned = [*seq.eos_token_ids, *params.stop_token_ids]
    if seq.bad_words_token_ids:
        banned += banned_next(seq.bad_words_token_ids, seq.output_token_ids)
    uses_prompt = params.repetition_penalty != 1.0
    uses_output = uses_prompt or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
    return SamplingRow(params=params, prompt_token_ids=seq.prompt_token_ids if uses_prompt else [],
                       output_token_ids=seq.output_token_ids if uses_output else [], generator=seq.generator,
                       banned_token_ids=banned)
