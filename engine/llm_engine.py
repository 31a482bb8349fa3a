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
from dataclasses import replace

import torch

from engine.block_manager import BlockManager
from engine.cpu_allocator import keep_freed_memory_in_heap
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_cache import GIB, KVCache, KVCacheSpec, gpu_kv_budget_bytes
from engine.model import ModelConfig, load_model
from engine.model.parallel import SINGLE_PROCESS, TensorParallel
from engine.output_processor import RequestTextState
from engine.outputs import RequestOutput
from engine.runner import ModelRunner
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel = SINGLE_PROCESS):
        self.config = config
        self.device = config.resolved_device()
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.model_config = ModelConfig.from_pretrained(config.model)
        mc = self.model_config
        self.max_model_len = self._resolve_max_model_len(config, mc)
        self.dtype = config.resolved_dtype(mc.torch_dtype)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.model = load_model(config.model, mc, max_positions=self.max_model_len, dtype=self.dtype,
                                device=self.device, tp=tp)
        attn = self.model.model.layers[0].self_attn
        spec = KVCacheSpec(mc.num_layers, attn.num_local_kv_heads, mc.head_dim, config.block_size, self.dtype)
        num_blocks = self._num_kv_blocks(config, spec)
        self.kv_cache = KVCache(spec, num_blocks, self.device)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill)
        batch_generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device, Sampler(batch_generator))
        self.eos_token_ids = tuple(dict.fromkeys(
            [*mc.eos_token_ids, *([self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else [])]))
        self._states: dict[str, RequestTextState] = {}
        self._held: dict[str, Sequence] = {}
        self._ids = itertools.count()

    # ---- set-up ---------------------------------------------------------------------------
    @staticmethod
    def _resolve_max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        if mc.sliding_window:
            limit = min(limit, mc.sliding_window)
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise ValueError(f"max_model_len ({config.max_model_len}) is larger than the model supports "
                             f"({limit}); set max_model_len <= {limit}")
        return config.max_model_len

    def _num_kv_blocks(self, config: EngineConfig, spec: KVCacheSpec) -> int:
        min_blocks = -(-self.max_model_len // spec.block_size)
        if config.num_kv_blocks is not None:
            num = config.num_kv_blocks
        elif self.device.type == "cuda":
            num = spec.num_blocks_for(gpu_kv_budget_bytes(self.device, config.gpu_memory_utilization))
        else:
            # no point reserving more than every sequence at full length could use
            num = min(spec.num_blocks_for(int(config.kv_cache_memory_gib * GIB)),
                      config.max_num_seqs * min_blocks)
        if num < min_blocks:
            raise ValueError(
                f"the KV cache holds {num} blocks of {spec.block_size} tokens, fewer than one sequence of "
                f"max_model_len={self.max_model_len} tokens needs ({min_blocks}); lower max_model_len or "
                "give the KV cache more memory (kv_cache_memory_gib / gpu_memory_utilization / num_kv_blocks)")
        return num

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

    # ---- offline helpers ------------------------------------------------------------------
    def run_to_completion(self) -> list[RequestOutput]:
        """Steps until every request finished; returns the final outputs in finish order."""
        done = []
        while self.has_unfinished_requests():
            done.extend(o for o in self.step() if o.finished)
        return done
