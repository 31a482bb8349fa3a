"""CUDA graphs of the decode step: the whole forward pass, embedding to logits,
captured once per padded batch size at start-up and replayed.

A decode step launches hundreds of small kernels; replaying a graph launches
them as one. A step of B decodes replays the graph of the smallest captured
size >= B: its inputs are copied into the graph's static buffers and the
padding rows are made harmless (no KV write: slot -1; one key to attend to).
Steps with prefill tokens, and larger decode batches, run eagerly.

Every rank captures and replays the same sizes, so the collectives inside the
layers (NCCL all-reduce, the logits gather) are captured in lockstep.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.model.attention_metadata import AttentionMetadata, PagedBatch

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to `max_batch` (and max_batch)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch] + list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, worker, sizes: list[int]):
        """`worker`: a ModelWorker whose KV cache is allocated. Captures at once."""
        self.worker = worker
        self.sizes = sorted(sizes)
        device = worker.device
        max_batch = self.sizes[-1]
        self.max_blocks = -(-worker.max_model_len // worker.kv_cache.spec.block_size)
        # static inputs: every captured graph reads prefixes of these
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=device)
        self.no_prefills = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor | None]] = {}
        self.pool_bytes = 0
        self._capture()

    def _meta(self, batch: int) -> AttentionMetadata:
        paged = PagedBatch(
            num_decodes=batch, block_tables=self.block_tables[:batch], seq_lens=self.seq_lens[:batch],
            prefill_query_start=self.no_prefills, max_prefill_query_len=0,
            decode_splits=self.worker.decode_splits(batch, self.worker.max_model_len))
        return AttentionMetadata(self.slot_mapping[:batch], [], [], paged)

    def _forward(self, batch: int) -> torch.Tensor | None:
        model = self.worker.model
        hidden = model(self.input_ids[:batch], self.positions[:batch], self.worker.kv_layers, self._meta(batch))
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self) -> None:
        started = time.monotonic()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.sizes):        # largest first: the smaller reuse its pool
                self._forward(batch)                  # warm-up: compiles kernels, creates handles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(batch)
                self.graphs[batch] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.pool_bytes = torch.cuda.memory_allocated() - before
        log.info("captured %d decode CUDA graphs (batch %d..%d) in %.1f s, %.0f MiB", len(self.sizes),
                 self.sizes[0], self.sizes[-1], time.monotonic() - started, self.pool_bytes / 2**20)

    def can_run(self, inputs) -> bool:
        """True for a decode-only step this instance captured a size for, every row of
        which is sampled (a prompt's last-but-one token, chunked alone when the step's
        budget ran out, looks like a decode but takes no sample: the graph's logits
        have a row per token), and which scores no prompt token."""
        batch = inputs.input_ids.shape[0]
        return inputs.is_decode_only and batch <= self.sizes[-1] and inputs.sample_indices.numel() == batch \
            and inputs.score_rows is None

    def run(self, inputs, fill=None) -> torch.Tensor | None:
        """Logits [B, vocab] for a decode-only step of B sequences (rank 0; None elsewhere).
        `inputs` are on the CPU, as the runner built them; `fill` (a TokenFill) sets
        input tokens that are only on the device."""
        batch = inputs.input_ids.shape[0]
        padded = next(b for b in self.sizes if b >= batch)
        paged = inputs.meta.paged
        # straight from pinned host memory into the static buffers: one copy each, no host wait
        _upload(self.input_ids[:batch], inputs.input_ids)
        if fill is not None:
            fill.applied_to(self.input_ids)
        _upload(self.positions[:batch], inputs.positions)
        _upload(self.slot_mapping[:batch], inputs.meta.slot_mapping)
        _upload(self.seq_lens[:batch], paged.seq_lens)
        _upload(self.block_tables[:batch, :paged.block_tables.shape[1]], paged.block_tables)
        if padded > batch:
            self.slot_mapping[batch:padded].fill_(-1)
            self.seq_lens[batch:padded].fill_(1)
        graph, logits = self.graphs[padded]
        graph.replay()
        return None if logits is None else logits[:batch]


def _upload(static: torch.Tensor, host: torch.Tensor) -> None:
    static.copy_(host.pin_memory(), non_blocking=True)
