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

Async scheduling (`config.async_scheduling`; on by default on CUDA): step()
schedules and launches the next batch before it reads back the samples of the
one launched by the previous call, so the host's scheduling, input preparation
and output processing run while the device computes. A step's outputs then come
from the next step() call. Work that reaches the KV cache from outside the
device's stream (KV transfers, read/write_kv_shards) is ordered after the
launched steps by the stream or by the read's own synchronisation.
"""

from __future__ import annotations

import itertools
import operator
import logging
import pickle
import secrets
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.bad_words import bad_word_sequences
from engine.block_manager import BlockManager
from engine.deferred_interrupt import interrupts_deferred
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError, RequestIdInUse
from engine.model.model_config import ModelConfig
from engine.model.parallel import SINGLE_PROCESS, TensorParallel
from engine.model_worker import KV_READ, KV_WRITE, RPC, ModelWorker, RankCallError, run_rank_call
from engine.output_processor import RequestTextState, ResumedText
from engine.outputs import OutputKind, RequestOutput, ResumedOutput
from engine.preflight import step_budget_problem, tensor_parallel_problem
from engine.runner import LaunchedStep, ModelRunner
from engine.sampler import SampleResult, Sampler, TokenLogprobs, seeded_generator, skip_draws
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler
from engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from engine.tiny_model import ensure_built_in_checkpoint
from engine.tokenizer import load_tokenizer
from engine.tp_group import RankProcesses, create_group, host_store, resolve_backend

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepStats:
    """The shape and wall time of one engine step (for cost estimates and the
    autoscaler's performance model: cluster/perf_model/step_shape.py)."""
    num_prefill_tokens: int
    num_decode_seqs: int
    duration_s: float
    prefill_attention: float = 0.0    # query-key pairs of the prompt chunks, causal
    decode_context: int = 0           # keys the decodes attend to, summed
    threads: int = 1                  # torch threads it ran with
    borrowed_threads: int = 0         # of which on cores borrowed from idle engines (engine/core_lending.py)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp: TensorParallel | None = None):
        """With `config.tensor_parallel_size > 1` and no `tp` given, starts the
        other ranks as local processes (stopped by `shutdown`)."""
        self.config = config
        self._ranks: RankProcesses | None = None
        self._broken: str | None = None
        try:
            config.check_devices()
            if tp is None:
                tp = self._start_ranks(config) if config.tensor_parallel_size > 1 else SINGLE_PROCESS
            self.tp = tp
            if self._ranks is None:
                self._start(config)
            else:
                self._ranks.watched(lambda: self._start(config))
                self.worker.adopt_calling_thread()
        except BaseException as exc:
            if self._ranks is not None:
                self._ranks.mark_broken()     # the others may wait in a collective: STOP could hang
            # rank 0 saw the group break (a communication error): say which rank failed, if one exited
            dead_rank = self._dead_rank() if _is_communication_error(exc) else None
            self.shutdown()
            if dead_rank is not None:
                raise RuntimeError(f"{dead_rank} while the engine started") from exc
            raise

    def _start(self, config: EngineConfig) -> None:
        self.worker = ModelWorker(config, self.tp)
        self._set_up(config)

    def _set_up(self, config: EngineConfig) -> None:
        self.device = self.worker.device
        self.model_config = mc = self.worker.model_config
        self.max_model_len = self.worker.max_model_len
        self.model = self.worker.model
        self.kv_cache = self.worker.kv_cache
        if problem := step_budget_problem(config, self.max_model_len):
            raise ValueError(problem)
        if config.tokenizer:
            ensure_built_in_checkpoint(config.tokenizer)     # a built-in model's, named on another node
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   enable_chunked_prefill=config.enable_chunked_prefill,
                                   max_model_len=self.max_model_len)
        if config.max_running_seqs < config.max_num_seqs:
            log.warning("max_num_seqs (%d) is more than max_num_batched_tokens (%d): at most %d sequences run at "
                        "once, as each takes a token of every step", config.max_num_seqs,
                        config.max_num_batched_tokens, config.max_running_seqs)
        batch_generator = seeded_generator(config.seed, self.device)
        self.runner = ModelRunner(self.worker, Sampler(batch_generator))
        # What ends a request (unless ignore_eos) and what min_tokens bans, on every path: the tokenizer's,
        # config.json's and generation_config.json's EOS ids, the tokenizer's first (a stop on it reports no
        # stop_reason, on another its id: vLLM's); an id outside the vocabulary is never sampled.
        tokenizer_eos = [] if self.tokenizer.eos_token_id is None else [self.tokenizer.eos_token_id]
        self.eos_token_ids = tuple(t for t in dict.fromkeys([*tokenizer_eos, *mc.eos_token_ids])
                                   if 0 <= t < mc.vocab_size)
        self._states: dict[str, RequestTextState] = {}
        self._held: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.last_step: StepStats | None = None   # the latest non-empty step
        self.async_scheduling = config.uses_async_scheduling()
        self._in_flight: _InFlight | None = None    # launched by the previous step() call, not read back
        # launched steps being read back, oldest first; left non-empty by an interrupted read-back
        # (an exception while waiting for or going through samples), which the next step() call
        # finishes before it schedules anything
        self._unresolved: list[_InFlight] = []
        self._outputs: list[RequestOutput] = []     # read back, not yet returned (kept across an interrupt)
        self.last_step_empty = False                 # the latest step() had nothing to run or read back
        self._last_resolved = time.monotonic()

    # ---- tensor-parallel ranks ----------------------------------------------------------
    def _start_ranks(self, config: EngineConfig) -> TensorParallel:
        size = config.tensor_parallel_size
        # a model that cannot be split so is refused here, not by every rank process started for it
        if problem := tensor_parallel_problem(ModelConfig.from_pretrained(config.model), size):
            raise ValueError(problem)
        device = config.resolved_device()
        backend = resolve_backend(config.tp_backend, device)
        store = host_store(size)
        # the gang's keys in the store under a name only its processes know: any local user can reach
        # a loopback store, and the control group carries pickled commands
        prefix = f"tp-{secrets.token_hex(16)}"
        self._ranks = RankProcesses(size, store.port, (config, backend, prefix))
        tp = self._ranks.watched(lambda: create_group(0, size, "127.0.0.1", store.port, backend, device,
                                                         prefix=prefix, store=store))
        self._ranks.attach(tp)
        return tp

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (empty without tensor parallelism)."""
        return self._ranks.pids if self._ranks else []

    def shutdown(self) -> None:
        """Stops the other ranks (if any); also happens when the engine is garbage
        collected or the interpreter exits. The engine cannot step afterwards."""
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None
        self._broken = self._broken or "the engine was shut down"

    def kill_ranks(self) -> None:
        """Terminates the other ranks at once, from any thread: for a shutdown whose engine
        thread is stuck (in a collective with them), which would never stop them itself."""
        ranks = self._ranks
        if ranks is not None:
            self._broken = self._broken or "the engine's ranks were terminated"
            ranks.kill()

    def _dead_rank(self, wait_s: float = 1.0) -> str | None:
        """Why a rank process ended, if one did (within `wait_s`: its peers see its
        sockets close a moment before it exits)."""
        deadline = time.monotonic() + wait_s
        while self._ranks is not None:
            if (problem := self._ranks.dead()) or time.monotonic() > deadline:
                return problem
            time.sleep(0.05)
        return None

    def _on_rank_error(self, exc: BaseException) -> None:
        """After a failure mid-step with several ranks (an interrupt included), the
        ranks may sit in different collectives: stop them all and refuse further steps."""
        if self.tp.size > 1:
            self._broken = f"the engine stopped after an error on a tensor-parallel rank: {exc}"
            if self._ranks is not None:
                self._ranks.mark_broken()
            self.shutdown()

    def rank_problem(self) -> str | None:
        """Why the tensor-parallel ranks cannot step, or None; only reads (any thread)."""
        ranks = self._ranks
        return self._broken or (ranks.dead() if ranks is not None else None)

    def _check_ranks(self) -> None:
        if self._broken:
            raise RuntimeError(self._broken)
        if self._ranks is not None and (problem := self._ranks.dead()):
            exc = RuntimeError(problem)
            self._on_rank_error(exc)
            raise exc

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; send at least one token", "prompt")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):     # bytes would pass for token ids
            raise InvalidRequestError(f"prompt must be text or a list of token ids; got {type(prompt).__name__}",
                                      "prompt")
        return [_as_token_id(t, i) for i, t in enumerate(prompt)]

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty; send at least one token", "prompt")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(token_ids):     # (ints: tokenize and a resume convert them)
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
            raise RequestIdInUse(f"request id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        try:
            params.validate_against_vocab(self.model_config.vocab_size)
        except SamplingParamsError as exc:
            raise InvalidRequestError(str(exc), exc.field) from None
        ending = {*self.eos_token_ids, *params.stop_token_ids}
        if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= ending:
            raise InvalidRequestError(
                f"allowed_token_ids allows only tokens that end the output ({sorted(ending)}), which min_tokens="
                f"{params.min_tokens} forbids until then: allow other tokens, or drop min_tokens",
                "allowed_token_ids")
        generator = None
        if params.seed is not None:
            generator = seeded_generator(params.seed, self.device)
        bad_words = bad_word_sequences(self.tokenizer, params, self.model_config.vocab_size, ending)
        return Sequence(request_id=request_id, token_ids=token_ids, num_prompt_tokens=len(token_ids),
                        params=params, eos_token_ids=self.eos_token_ids, generator=generator,
                        prompt_logprobs=None if params.prompt_logprobs is None else [None],
                        bad_words_token_ids=bad_words)

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    params: SamplingParams | None = None, *, hold_kv: bool = False,
                    resume: ResumedOutput | None = None, resumed_text: ResumedText | None = None,
                    output_kind: OutputKind = OutputKind.CUMULATIVE, arrival_time: float | None = None) -> str:
        """Queues a request; returns its id. Raises InvalidRequestError (nothing
        queued, nothing else affected) for a bad prompt or parameters.
        `output_kind`: what its outputs carry (engine/outputs.py).
        With `hold_kv` the request stops after its first token and keeps its
        blocks (prefill role); that token's output is `finished` only when the
        request really ended there (EOS, a stop, max_tokens=1). With `resume`
        it continues after output it already produced on another worker (the
        prompt and that output are prefilled together, as after a preemption);
        `resumed_text`: output_processor.resumed_text's for it, made off this thread."""
        seq = self._new_sequence(request_id, prompt, params)
        seq.hold_kv = hold_kv
        if arrival_time is not None:      # (time.monotonic() when the caller took the request: its queue wait
            seq.arrival_time = arrival_time   # counts the wait for this call between engine steps too)
        state = RequestTextState(seq, self.tokenizer, self.max_model_len, output_kind)
        if resume is not None:
            self._resume(seq, state, resume, resumed_text)
        self._states[seq.request_id] = state
        self.scheduler.add(seq)
        return seq.request_id

    def _resume(self, seq: Sequence, state: RequestTextState, resume: ResumedOutput,
                text: ResumedText | None) -> None:
        """Puts `resume`'s tokens after the prompt as the request's own output."""
        if seq.hold_kv:
            raise InvalidRequestError("a resumed request cannot hold its KV for a hand-off", "resume")
        if seq.params.prompt_logprobs is not None:
            raise InvalidRequestError("a resumed request's prompt logprobs went out with its first output: "
                                      "resume it with prompt_logprobs=None", "prompt_logprobs")
        if len(resume.token_ids) >= seq.params.max_tokens:
            raise InvalidRequestError(f"the request already has {len(resume.token_ids)} output tokens, its "
                                      f"max_tokens ({seq.params.max_tokens}): nothing is left to generate",
                                      "resume")
        resumed = [_as_token_id(t, i) for i, t in enumerate(resume.token_ids)]
        self.validate_prompt(seq.token_ids + resumed)
        if seq.params.logprobs is not None and \
                (resume.logprobs is None or len(resume.logprobs) != len(resume.token_ids)):
            raise InvalidRequestError("the request asks for logprobs: resume.logprobs must hold one entry per "
                                      f"resumed token ({len(resume.token_ids)})", "resume")
        seq.token_ids.extend(resumed)
        if seq.generator is not None and not seq.params.is_greedy:
            if resume.generator_state is not None:
                seq.generator.set_state(resume.generator_state)
            else:
                skip_draws(seq.generator, len(resume.token_ids), self.model_config.vocab_size)
        state.resume(resume, text)

    def abort_request(self, request_id: str) -> bool:
        """Stops a request wherever it is and frees its blocks. False if unknown.
        The caller must first finish or cancel any KV transfer into or out of
        the request's blocks: once freed they can be handed to another request."""
        with interrupts_deferred():         # not forgotten with its blocks still held
            state = self._states.pop(request_id, None)
            if state is None:
                return self.release_kv(request_id)
            state.seq.finish_reason = "abort"
            self.scheduler.finish(state.seq)
            state.seq.status = SequenceStatus.FINISHED
            return True

    def has_unfinished_requests(self) -> bool:
        """True while a step() call has work: requests to run, or samples to read back."""
        return self.scheduler.num_unfinished > len(self.scheduler.reserved) or self._in_flight is not None \
            or bool(self._unresolved)

    # ---- the step -----------------------------------------------------------------------
    def step(self, *, prefill: bool = True, decode: bool = True) -> list[RequestOutput]:
        """Runs one batch. Returns an output for every request that produced a
        token (or finished) in a step whose samples were read back in this call:
        this call's step, or with async scheduling the previous call's. Sets
        `last_step_empty` when there was nothing to run or read back: the
        requests waiting cannot start until blocks or sequence slots that held
        or reserved requests keep are freed."""
        self._check_ranks()
        if self._unresolved:        # what an interrupted call left: read back first (result() may be asked again)
            self.last_step_empty = False
            self._read_back()
            return self._take_outputs()
        previous = self._in_flight   # (cleared only once this call has launched: an interrupt keeps it)
        step = self.scheduler.schedule(prefill=prefill, decode=decode)
        # a step that only preempted freed blocks: the next one can run what waits
        self.last_step_empty = step.is_empty and not step.preempted and previous is None
        launched = self._launch(step, previous) if not step.is_empty else None
        # every launched step is read back in order (the launched one's inputs may be the previous
        # one's samples, on the device); an interrupted read-back leaves the rest to the next call
        self._unresolved = [s for s in (previous, launched) if s is not None]
        self._in_flight = None
        keep = launched if launched is not None and launched.run.overlapped else None
        self._read_back(until=keep)
        self._in_flight, self._unresolved = keep, []
        return self._take_outputs()

    def _read_back(self, until: _InFlight | None = None) -> None:
        """Reads back self._unresolved in order, stopping at `until` (left in flight); a step
        leaves the list only once read back whole, so an interrupt leaves the rest for the
        next call."""
        while self._unresolved and self._unresolved[0] is not until:
            self._resolve(self._unresolved[0])
            self._unresolved.pop(0)

    def _take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def _launch(self, step, previous: _InFlight | None) -> _InFlight:
        """Queues the step on the device; its sequences' new tokens become pending
        when their samples stay there."""
        started = time.monotonic()
        for seq in step.seqs:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = started
        shape = _step_shape(step)     # before after_step() counts the step's tokens as computed
        try:
            run = self.runner.launch(step, previous.run if previous else None, overlap=self.async_scheduling)
        except BaseException as exc:
            self._on_rank_error(exc)
            raise
        self.scheduler.after_step(step)
        if run.overlapped:
            for seq in run.sampled:
                seq.token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens += 1
        threads = torch.get_num_threads()     # a CPU engine's own, or more on borrowed idle cores
        return _InFlight(run, started, *shape, threads, max(0, threads - self.worker.num_threads))

    def _resolve(self, launched: _InFlight) -> None:
        """Reads back a launched step's samples and turns them into outputs (into
        self._outputs). A sequence that ended (or was aborted) since the launch drops
        its sample. Resumable: a read-back interrupted midway goes on, when called
        again, from the row it had reached."""
        try:
            result = launched.run.result()
        except BaseException as exc:
            self._on_rank_error(exc)
            raise
        now = time.monotonic()
        if launched.next_row == 0:
            step = launched.run.step
            self.last_step = StepStats(step.num_prefill_tokens, step.num_decode_seqs,
                                       now - max(launched.started, self._last_resolved),
                                       launched.prefill_attention, launched.decode_context, launched.threads,
                                       launched.borrowed_threads)
            self._last_resolved = now
            for span, entries in launched.run.prompt_logprobs:
                state = self._states.get(span.seq.request_id)
                if state is not None and state.seq is span.seq:
                    span.seq.prompt_logprobs[span.first:span.first + span.count] = entries
        if result is None:
            return
        with interrupts_deferred():         # each row's token appended once, a finished row's blocks freed
            self._read_rows(launched, result, now)

    def _read_rows(self, launched: _InFlight, result: SampleResult, now: float) -> None:
        """_resolve's rows, from `launched.next_row` on: each row's token appended to its
        sequence, its output made, a finished sequence's blocks freed."""
        rows = launched.run.sampled
        while launched.next_row < len(rows):
            i, seq = launched.next_row, rows[launched.next_row]
            state = self._states.get(seq.request_id)
            if state is not None and state.seq is seq:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                if launched.appended < i:
                    state.append(result.token_ids[i], result.logprobs[i])
                    launched.appended = i
                finished = seq.finish_reason is not None
                out = state.make_output(finished, final=finished or seq.hold_kv)
                if out is not None:
                    self._outputs.append(out)
                if finished or seq.hold_kv:
                    self._finish(seq)
            launched.next_row = i + 1

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
        its lease expires). False if it holds none. As with abort_request, no
        transfer may still be reading the blocks."""
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False
        self.block_manager.free(seq.block_table)
        return True

    def reserve_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                          params: SamplingParams, *, first_logprobs: TokenLogprobs | None = None,
                          generator_state: torch.Tensor | None = None,
                          first_token_emitted: bool = False,
                          output_kind: OutputKind = OutputKind.CUMULATIVE) -> list[int] | None:
        """Decode role: allocates blocks for the prompt's K/V, which the caller
        writes into `kv_cache` (block i of the returned table holds prompt tokens
        [i*block_size, (i+1)*block_size)). None when the blocks do not fit now,
        or the batch already holds `max_num_seqs` sequences (reserved included).
        `first_logprobs` is the first token's logprobs when the request asks for
        them; `generator_state` is the prefill side's seeded generator after the
        first token (`held_sequence(id).generator.get_state()`), so seeded sampling
        continues exactly as it would in one engine. With `first_token_emitted`
        the caller already streamed the first token (and its text) from the
        prefill side: this request's outputs carry only what follows it.
        `output_kind`: what its outputs carry (engine/outputs.py)."""
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a string, got {request_id!r}", "request_id")
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        seq.prompt_logprobs = None     # the prefill side scored the prompt and sent them with the first token
        self.validate_prompt([first_token_id])
        if params.logprobs is not None and first_logprobs is None:
            raise InvalidRequestError("the request asks for logprobs: pass the first token's first_logprobs",
                                      "logprobs")
        if seq.generator is not None and not params.is_greedy:
            if generator_state is not None:
                seq.generator.set_state(generator_state)
            else:     # past the draw the first token took, as a resumed request skips its tokens' draws
                skip_draws(seq.generator, 1, self.model_config.vocab_size)
        if not self.scheduler.reserve(seq, seq.num_prompt_tokens):
            return None
        try:
            state = RequestTextState(seq, self.tokenizer, self.max_model_len, output_kind)
            seq.first_scheduled_time = seq.first_token_time = seq.arrival_time
            state.append(first_token_id, first_logprobs)
            if first_token_emitted:
                state.make_output(False)   # the prefill side streamed it: outputs start after it
        except BaseException:
            self.scheduler.finish(seq)     # nothing of it stays reserved
            raise
        self._states[request_id] = state
        return list(seq.block_table)

    def commit_prefilled(self, request_id: str) -> RequestOutput | None:
        """Decode role: the reserved blocks are filled; the request joins the batch.
        Returns the output carrying the first token (finished if it already ended;
        None for a FINAL_ONLY request that goes on)."""
        seq = self.scheduler.reserved.get(request_id)
        if seq is None:
            raise InvalidRequestError(f"request {request_id!r} has no reserved blocks (never reserved, "
                                      "already committed, or aborted)", "request_id")
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
        self._check_block_ids(block_ids)
        self._check_ranks()
        try:
            if self.tp.size > 1:
                self.tp.broadcast_object((KV_READ, block_ids))
            return [t.cpu() for t in self.tp.gather_to_first(self.worker.read_kv(block_ids))]
        except BaseException as exc:
            self._on_rank_error(exc)
            raise

    def write_kv_shards(self, block_ids: list[int], shards: list[torch.Tensor]) -> None:
        """Inverse of read_kv_shards: rank r's blocks get shards[r]. (Every shard
        goes through rank 0 to every rank: for offline hand-offs and tests; the
        serving path ships each rank's heads over its own pair group.)"""
        self._check_block_ids(block_ids)
        expected = (*self.kv_cache.tensor.shape[:2], len(block_ids), *self.kv_cache.tensor.shape[3:])
        if len(shards) != self.tp.size or any(tuple(s.shape) != expected for s in shards):
            raise ValueError(f"expected {self.tp.size} KV shard(s) of shape {expected}, got "
                             f"{[tuple(s.shape) for s in shards]}")
        self._check_ranks()
        try:
            if self.tp.size > 1:
                self.tp.broadcast_object((KV_WRITE, (block_ids, shards)))
            self.worker.write_kv(block_ids, shards[0])
        except BaseException as exc:
            self._on_rank_error(exc)
            raise

    def _check_block_ids(self, block_ids: list[int]) -> None:
        n = self.kv_cache.num_blocks
        bad = [b for b in block_ids if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < n]
        if bad:
            raise ValueError(f"block ids {bad[:5]} are outside the KV cache's blocks [0, {n})")

    def collective_rpc(self, fn, *args) -> list:
        """Runs `fn(worker, *args)` on every rank (rank 0 here, between steps)
        and returns the results in rank order. `fn` must be a picklable
        module-level function. With several ranks, a failure on any rank raises
        RankCallError (the ranks stay usable); with one, fn's own exception."""
        self._check_ranks()
        if self.tp.size == 1:
            return [fn(self.worker, *args)]
        try:
            call = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:   # before anything is sent: the ranks stay in step
            raise TypeError(f"collective_rpc needs a picklable module-level function and arguments: {exc}") \
                from None
        try:
            self.tp.broadcast_object((RPC, call))
            results = self.tp.gather_objects_to_first(run_rank_call(self.worker, fn, args))
        except BaseException as exc:
            self._on_rank_error(exc)
            raise
        for r in results:
            if isinstance(r, RankCallError):
                raise r
        return results

    # ---- offline helpers ------------------------------------------------------------------
    def run_to_completion(self) -> list[RequestOutput]:
        """Steps until every request finished (or, with hold_kv, holds its KV);
        returns the final outputs in finish order. Raises RuntimeError when the
        requests left wait for blocks that held or reserved ones keep."""
        done = []
        while self.has_unfinished_requests():
            done.extend(o for o in self.step() if o.finished or o.request_id in self._held)
            self.raise_if_blocked()
        return done

    def raise_if_blocked(self) -> None:
        """For a loop that only steps (nothing in it can free what the waiting requests
        need): raises RuntimeError when the latest step had nothing to run."""
        if self.last_step_empty:
            raise RuntimeError(
                f"{len(self.scheduler.waiting)} requests wait for KV blocks or sequence slots that "
                f"{len(self._held)} held and {len(self.scheduler.reserved)} reserved requests keep; "
                "release them (release_kv) or give the engine more KV cache")


@dataclass(slots=True)
class _InFlight:
    """A launched step, with what its StepStats needs, and how far its read-back got."""
    run: LaunchedStep
    started: float
    prefill_attention: float
    decode_context: int
    threads: int
    borrowed_threads: int
    next_row: int = 0          # sampled rows read back so far
    appended: int = -1         # the last row whose token its request took


def _is_communication_error(exc: BaseException) -> bool:
    """A failed collective (a peer went away), as opposed to rank 0's own error, which
    every rank may have hit alike (a bad setting, a missing checkpoint)."""
    return type(exc) is RuntimeError or isinstance(exc, dist.DistError)


def _step_shape(step) -> tuple[float, int]:
    """(prefill attention pairs, decode context) of a scheduled step, before it
    runs: its sequences' num_computed_tokens must not count the step's tokens yet
    (the same shapes cluster/perf_model/profiler.py fits a profile on)."""
    d = step.num_decode_seqs
    decode_context = sum(seq.num_computed_tokens + 1 for seq in step.seqs[:d])
    attention = 0.0
    for seq, n in zip(step.seqs[d:], step.num_new_tokens[d:]):
        attention += n * (seq.num_computed_tokens + (n + 1) / 2)
    return attention, decode_context


def _as_token_id(value: object, position: int) -> int:
    """`value` as a Python int token id (a numpy or torch integer too); InvalidRequestError
    for anything else (a bool, a float, a character of a string passed as ids)."""
    # (operator.index takes a bool tensor, and a one-element tensor of any shape, for an integer)
    tensor = isinstance(value, torch.Tensor)
    if not isinstance(value, bool) and not (tensor and (value.dtype == torch.bool or value.dim() != 0)):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidRequestError(f"prompt token ids must be integers; got {type(value).__name__} {value!r} at "
                              f"position {position}", "prompt")
