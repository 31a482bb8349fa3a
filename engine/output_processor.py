"""Turns sampled tokens into text and decides when a request is done.

Per request: incremental detokenization, stop conditions (EOS, stop token ids,
stop strings, max_tokens, context length), and streaming deltas. A stop string is
cut from the text (with what follows it), unless the request keeps it
(`include_stop_str_in_output`: then only what follows); while one could still be
forming at the end of the text, those last characters are held back from the
stream, so a client never sees a stop string it has to take back.

What an output carries is the consumer's choice (engine.outputs.OutputKind):
DELTA outputs cost O(new tokens) whatever the request's length, which is what
a streaming server asks for; CUMULATIVE copies everything so far every time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Ids
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import OutputKind, RequestOutput, ResumedOutput
from engine.sampler import TokenLogprobs
from engine.sequence import Sequence
from engine.text_buffer import TextBuffer


@dataclass(slots=True)
class ResumedText:
    """The text of output a request produced elsewhere, with the detokenizer that
    read it (resumed_text)."""
    detokenizer: IncrementalDetokenizer
    text: TextBuffer


def resumed_text(tokenizer, prompt_token_ids: Ids[int], skip_special_tokens: bool,
                 token_ids: Ids[int]) -> ResumedText:
    """Detokenizes a resumed request's output after its prompt, as RequestTextState
    does token by token: two window decodes a token, which a caller with many
    long requests to resume runs off the engine thread."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
    text = TextBuffer()
    for token_id in token_ids:
        text.append(detokenizer.add_token(token_id))
    return ResumedText(detokenizer, text)


class RequestTextState:
    def __init__(self, seq: Sequence, tokenizer, max_model_len: int,
                 output_kind: OutputKind = OutputKind.CUMULATIVE):
        self.seq = seq
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.output_kind = output_kind
        params = seq.params
        self.prompt_token_ids = seq.prompt_token_ids      # copied once: every output shares it
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids,
                                                  skip_special_tokens=params.skip_special_tokens)
        self.stop_strings = list(params.stop)
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=1)
        self.keep_stop = params.include_stop_str_in_output
        self.hold_back = 0 if self.keep_stop else self.max_stop_len - 1     # a kept stop is never taken back
        self.text = TextBuffer()
        self.num_emitted_chars = 0
        self.num_emitted_tokens = 0
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs_sent = False

    def resume(self, resumed: ResumedOutput, text: ResumedText | None = None) -> None:
        """Takes in the output a request already produced elsewhere (its tokens
        are in seq.token_ids): its text is rebuilt, so that a stop string may
        span it, and outputs carry only what follows it (text the failed worker
        held back included). `text`: resumed_text's for this prompt and these
        tokens, when the caller rebuilt it already."""
        if text is None:
            text = resumed_text(self.tokenizer, self.prompt_token_ids, self.seq.params.skip_special_tokens,
                                resumed.token_ids)
        self.detokenizer, self.text = text.detokenizer, text.text
        self.num_emitted_tokens = len(resumed.token_ids)
        self.num_emitted_chars = min(resumed.num_sent_chars, len(self.text))
        if self.logprobs is not None and resumed.logprobs is not None:
            self.logprobs = list(resumed.logprobs)   # outputs' logprobs stay one per token

    def append(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """Adds a sampled token to the sequence (in place of its oldest pending
        token, if it has one); sets seq.finish_reason when it ends it."""
        seq, params = self.seq, self.seq.params
        if seq.num_pending_tokens:
            index = seq.num_known_tokens
            seq.token_ids[index] = token_id
            seq.num_pending_tokens -= 1
        else:
            index = len(seq.token_ids)
            seq.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        n_out = index + 1 - seq.num_prompt_tokens
        past_min = n_out >= params.min_tokens
        eos = not params.ignore_eos and token_id in seq.eos_token_ids
        if past_min and (eos or token_id in params.stop_token_ids):
            if self.keep_stop:      # as vLLM: the ending token's text too (none for a skipped special token),
                prev_len = len(self.text)          # where a stop string ends first, as in any other token's
                self.text.append(self.detokenizer.add_token(token_id))
                if n_out > params.min_tokens and self.stop_strings and self._check_stop_strings(prev_len):
                    return
            # vLLM's: no stop_reason for the model's main EOS; the id of another (generation_config's extra
            # EOS ids, a stop_token_ids entry)
            self._finish("stop", None if eos and token_id == seq.eos_token_ids[0] else token_id)
            return
        prev_len = len(self.text)
        self.text.append(self.detokenizer.add_token(token_id))
        # as vLLM: stop strings count only once the output is past min_tokens (not at it)
        if n_out > params.min_tokens and self.stop_strings and self._check_stop_strings(prev_len):
            return
        if n_out >= params.max_tokens or index + 1 >= self.max_model_len:
            self._finish("length", None)

    def _check_stop_strings(self, prev_len: int) -> bool:
        # a new match must end in the text this token added: an older one (completed before
        # min_tokens) never ends the request later
        window_start = max(0, prev_len - self.max_stop_len + 1)
        window = self.text.slice(window_start)
        # as vLLM: the stop string that completes first in the text (ties: the stop list's order), so the
        # result is what appending one character at a time gives, however the text was tokenized
        best = None
        for stop in self.stop_strings:
            i = window.find(stop, max(0, prev_len - len(stop) + 1 - window_start))
            if i != -1 and (best is None or i + len(stop) < best[0] + len(best[1])):
                best = (i, stop)
        if best is None:
            return False
        self.text.truncate(window_start + best[0] + (len(best[1]) if self.keep_stop else 0))
        self._finish("stop", best[1])
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        seq = self.seq
        if seq.num_pending_tokens:      # a token sampled after the last one: never part of the output
            del seq.token_ids[seq.num_known_tokens:]
            seq.num_pending_tokens = 0
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if reason != "stop" or isinstance(stop_reason, int) or stop_reason is None:
            self.text.append(self.detokenizer.flush())

    def make_output(self, finished: bool, *, final: bool | None = None) -> RequestOutput | None:
        """The output of what the request produced since the previous one (in
        the request's output kind). `final`: this is the request's last output
        from this engine (default: `finished`; also a held prefill); FINAL_ONLY
        gives None until then."""
        final = finished if final is None else final
        if self.output_kind is OutputKind.FINAL_ONLY and not final:
            return None
        seq = self.seq
        num_text = len(self.text)
        visible = num_text if finished else max(self.num_emitted_chars, num_text - self.hold_back)
        delta_text = self.text.slice(self.num_emitted_chars, visible)
        known = seq.num_known_tokens
        delta_ids = seq.token_ids[seq.num_prompt_tokens + self.num_emitted_tokens:known]
        num_out = known - seq.num_prompt_tokens
        self.num_emitted_chars, self.num_emitted_tokens = visible, num_out
        prompt_logprobs = seq.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) != seq.num_prompt_tokens:
            raise RuntimeError(f"request {seq.request_id}: an output before every prompt token was scored "
                               f"({len(prompt_logprobs)} of {seq.num_prompt_tokens})")
        if self.output_kind is OutputKind.DELTA:
            text, token_ids = delta_text, delta_ids
            logprobs = self.logprobs[len(self.logprobs) - len(delta_ids):] if self.logprobs is not None else None
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = self.prompt_logprobs_sent or prompt_logprobs is not None
        else:
            whole = self.text.value()
            text, token_ids = whole[:visible], seq.output_token_ids
            logprobs = list(self.logprobs) if self.logprobs is not None else None
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=self.prompt_token_ids,
            text=text,
            token_ids=token_ids,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_cached_tokens=seq.num_cached_prompt_tokens,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
            finished_time=time.monotonic() if finished else None,
            num_output_tokens=num_out,
        )
