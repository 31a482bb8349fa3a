"""The engine: requests in, one step at a time, outputs out (single process).

    add_request ──▶ Scheduler.waiting ──step()──▶ running ──▶ finished
                                             │
                     ModelRunner.execute(step): build batch, forward, sample
                                             │
                     RequestTextState: detokenize, stop checks, deltas

Disaggregated roles use the same engine:
- prefill: add_request(..., hold_kv=True) then step(decode=False); the request
  ends after its first token but keeps its blocks (`held_block_table`) until
  `release_kv`.
- decode: `reserve_prefilled` allocates blocks for a prompt whose K/V will be
  written into `kv_cache` from outside, `commit_prefilled` admits it into the
  running batch with its first token already sampled; step(prefill=False).
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.model.parallel import SINGLE_PROCESS, TensorParallel
from engine.model_worker import KV_READ, KV_WRITE, STOP, ModelWorker, cpu_threads_per_rank
from engine.output_processor import RequestTextState
from engine.outputs import RequestOutput
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import load_tokenizer
from engine.tp_group import RankProcesses, create_group, free_port, resolve_backend

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None):
        """With `config.tensor_parallel_size > 1` and no `tp` given, starts the
        other ranks as local processes (stopped by `shutdown`)."""
        self.config = config
        self._ranks = None
        if tp is None:
            tp = self._start_ranks(config) if config.tensor_parallel_size > 1 else SINGLE_PROCESS
        self.tp = tp
        try:
            self.worker = ModelWorker(config, tp)
        except BaseException:
            self._stop_ranks()
            raise
        self.device = self.worker.device
        self.model_config = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.model = self.worker.model
        self.kv_cache = self.worker.kv_cache
        mc = self.model_config
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        num_blocks = self.kv_cache.num_blocks
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        batch_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.runner = ModelRunner(self.worker, Sampler(batch_generator))
        self.eos_token_ids = tuple(dict.fromkeys(
            [*mc.eos_token_ids, *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])]))
        self._states: dict[str, RequestTextState] = {}
        self._held: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # ---- tensor-parallel ranks ----------------------------------------------------------
    def _start_ranks(self, config: EngineConfig) -> TensorParallel:
        size = config.tensor_parallel_size
        device = config.resolved_device()
        backend = resolve_backend(config.tp_backend, device)
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads_per_rank(size))
        port = free_port()
        self._ranks = RankProcesses(size, port, (config, backend))
        try:
            tp = self._ranks.join_group(lambda: create_group(0, size, "127.0.0.1", port, backend, device))
        except BaseException:
            self._stop_ranks()
            raise
        self._finalizer = weakref.finalize(self, _stop_ranks, tp, self._ranks)
        return tp

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (empty without tensor parallelism)."""
        return self._ranks.pids if self._ranks else []

    def shutdown(self) -> None:
        """Stops the other ranks (if any); also runs when the engine is garbage
        collected or the interpreter exits. The engine cannot step afterwards."""
        if self._ranks is not None:
            self._finalizer()
            self._ranks = None

    def _stop_ranks(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; send at least one token", "prompt")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty; send at least one token", "prompt")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(token_ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token id {t!r} at position {i} is outside the vocabulary [0, {vocab})", "prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens but the model's context is {self.max_model_len} "
                f"tokens (max_model_len); shorten the prompt to at most {self.max_model_len - 1} tokens",
                "prompt")

    def _new_sequence(self, request_id: str | None, prompt: str | list[int],
                      params: SamplingParams | None) -> Sequence:
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._states or request_id in self._held:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        try:
            params.validate_against_vocab(self.model_config.vocab_size)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), "stop_token_ids") from None
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return Sequence(request_id=request_id, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                        params=params, eos_token_ids=self.eos_token_ids, generator=generator)

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, *, hold_kv: bool = False) -> str:
        """Queues a request; returns its id. Raises InvalidRequestError (nothing
        queued, nothing else affected) for a bad prompt or parameters."""
        seq = self._new_sequence(request_id, prompt, params)
        if hold_kv:
            seq.hold_kv = True
            seq.params = replace(seq.params, max_tokens=1, min_tokens=0)
        self._states[seq.request_id] = RequestTextState(seq, self.tokenizer, self.max_model_len)
        self.scheduler.add(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks. False if unknown."""
        state = self._states.pop(request_id, None)
        if state is None:
            return self.release_kv(request_id)
        state.seq.finish_reason = "abort"
        self.scheduler.finish(state.seq)
        state.seq.status = SequenceStatus.FINISHED
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > len(self.scheduler.reserved)

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- the step -----------------------------------------------------------------------
    def step(self, *, prefill: bool = True, decode: bool = True) -> list[RequestOutput]:
        """Runs one batch. Returns an output for every request that produced a
        token (or finished) in this step."""
        step = self.scheduler.schedule(prefill=prefill, decode=decode)
        if step.is_empty:
            return []
        sampled, result = self.runner.execute(step)
        self.scheduler.after_step(step)
        outputs = []
        if result is None:
            return outputs
        now = time.monotonic()
        for i, seq in enumerate(sampled):
            state = self._states[seq.request_id]
            if seq.first_token_time is None:
                seq.first_token_time = now
            state.append(result.token_ids[i], result.logprobs[i])
            finished = seq.finish_reason is not None
            if finished:
                self._finish(seq)
            outputs.append(state.make_output(finished))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        del self._states[seq.request_id]
        if seq.hold_kv:
            self.scheduler.finish(seq, keep_blocks=True)
            seq.status = SequenceStatus.HELD
            self._held[seq.request_id] = seq
        else:
            self.scheduler.finish(seq)
            seq.status = SequenceStatus.FINISHED

    # ---- disaggregation hooks ---------------------------------------------------------
    def held_sequence(self, request_id: str) -> Sequence:
        """Prefill role: the finished request whose blocks are still held."""
        return self._held[request_id]

    def release_kv(self, request_id: str) -> bool:
        """Prefill role: frees a held request's blocks (after the hand-off, or when
        its lease expires). False if it holds none."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.block_table)
        return True

    def reserve_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                          params: SamplingParams) -> list[int] | None:
        """Decode role: allocates blocks for the prompt's K/V, which the caller
        writes into `kv_cache` (block i of the returned table holds prompt tokens
        [i*block_size, (i+1)*block_size)). None when the blocks do not fit now."""
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        if not self.scheduler.reserve(seq, seq.num_prompt_tokens):
            return None
        state = RequestTextState(seq, self.tokenizer, self.max_model_len)
        self._states[request_id] = state
        seq.first_token_time = seq.arrival_time
        state.append(first_token_id, None)
        return list(seq.block_table)

    def commit_prefilled(self, request_id: str) -> RequestOutput:
        """Decode role: the reserved blocks are filled; the request joins the batch.
        Returns the output carrying the first token (finished if it already ended)."""
        seq = self.scheduler.reserved[request_id]
        state = self._states[request_id]
        self.scheduler.mark_filled(seq, seq.num_prompt_tokens)
        finished = seq.finish_reason is not None
        if finished:
            self._finish(seq)
        return state.make_output(finished)

    def read_kv_shards(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Every rank's K/V of the blocks, in rank order; rank r's tensor holds the
        KV heads `kv_heads_of_rank(num_kv_heads, tp, r)`:
        [layers, 2, len(block_ids), block_size, local_kv_heads, head_dim]."""
        if self.tp.size > 1:
            self.tp.broadcast_object((KV_READ, block_ids))
        return [t.cpu() for t in self.tp.gather_to_first(self.worker.read_kv(block_ids))]

    def write_kv_shards(self, block_ids: list[int], shards: list[torch.Tensor]) -> None:
        """Inverse of read_kv_shards: rank r's blocks get shards[r]."""
        if len(shards) != self.tp.size:
            raise ValueError(f"got KV shards for {len(shards)} ranks, this engine has {self.tp.size}")
        if self.tp.size > 1:
            self.tp.broadcast_object((KV_WRITE, (block_ids, shards)))
        self.worker.write_kv(block_ids, shards[0])

    # ---- offline helpers ------------------------------------------------------------------
    def run_to_completion(self) -> list[RequestOutput]:
        """Steps until every request finished; returns the final outputs in finish order."""
        done = []
        while self.has_unfinished_requests():
            done.extend(o for o in self.step() if o.finished)
        return done


def _stop_ranks(tp: TensorParallel, ranks: RankProcesses) -> None:
    try:
        tp.broadcast_object((STOP, None))
    except Exception:  # a rank already gone: the rest are terminated below
        log.warning("could not tell the tensor-parallel ranks to stop; terminating them")
    ranks.stop()
