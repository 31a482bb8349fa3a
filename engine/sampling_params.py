"""Per-request sampling parameters, validated on construction (vLLM semantics)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Below this temperature a request is decoded greedily; dividing logits by a
# near-zero temperature would only overflow towards the same argmax.
GREEDY_TEMPERATURE = 1e-5
MIN_TEMPERATURE = 1e-2       # a positive temperature below it is raised to it (vLLM's)
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0       # OpenAI's range for a token's bias, either way
MAX_BAD_WORDS = 128
_SEED_LIMIT = 2**63


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; the message starts
    with the field's name, which `field` holds."""

    @property
    def field(self) -> str:
        return str(self).split(" ", 1)[0]


def _check_int(name: str, value: object, allowed: str) -> int:
    # bool is an int subclass, but max_tokens=True is always a caller bug.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamsError(
            f"{name} must be an int {allowed}, got {value!r} ({type(value).__name__})")
    return int(value)


def _check_float(name: str, value: object, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamsError(
            f"{name} must be a number {allowed}, got {value!r} ({type(value).__name__})")
    try:
        value = float(value)
    except OverflowError:      # an int past float's range (JSON allows any number of digits)
        raise SamplingParamsError(f"{name} must be a finite number {allowed}, got an int of "
                                  f"{int(value).bit_length()} bits") from None
    if not math.isfinite(value):
        raise SamplingParamsError(f"{name} must be a finite number {allowed}, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SamplingParamsError(
            f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _out_of_range(name: str, value: object, allowed: str) -> SamplingParamsError:
    return SamplingParamsError(f"{name} must be {allowed}, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request.

    Construction validates every field and normalises the convenience forms
    (stop=None or a single str -> list, stop_token_ids=None -> [], top_k=-1 -> 0,
    int floats -> float). Raises SamplingParamsError naming the field, the value
    and the allowed range. Fields are not re-validated if mutated afterwards.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                      # 0 (or -1 on input) = disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0     # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None         # top-N to return; 0 = sampled token only
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (None: not computed)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False   # a stop string that ends the output stays in its text
    logit_bias: dict[int, float] = field(default_factory=dict)   # token id -> added to its logit
    allowed_token_ids: list[int] | None = None   # only these may be sampled (None: any)
    bad_words: list[str] = field(default_factory=list)   # words the output may not contain (engine/bad_words.py)
    # vLLM's; either value decodes the same here (the tokenizer joins special tokens as it does), as the
    # server takes it
    spaces_between_special_tokens: bool = True
    detokenize: bool = True             # vLLM's; False (token ids without text) is not supported

    def __post_init__(self) -> None:
        self.max_tokens = _check_int("max_tokens", self.max_tokens, ">= 1")
        if self.max_tokens < 1:
            raise _out_of_range("max_tokens", self.max_tokens, ">= 1")

        # `not (lo <= v)` rather than `v < lo` so that any NaN slipping through fails too. [0, 2] as
        # vLLM (0.32) and OpenAI take it; a positive one under MIN_TEMPERATURE is raised to it, as
        # vLLM does (dividing logits by less overflows float16 and bfloat16)
        self.temperature = _check_float("temperature", self.temperature, "in [0, 2]")
        if not 0.0 <= self.temperature <= 2.0:
            raise _out_of_range("temperature", self.temperature, "in [0, 2]")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE

        self.top_p = _check_float("top_p", self.top_p, "in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise _out_of_range("top_p", self.top_p, "in (0, 1]")

        top_k_allowed = "-1 or 0 (disabled), or >= 1"
        self.top_k = _check_int("top_k", self.top_k, top_k_allowed)
        if self.top_k < -1:
            raise _out_of_range("top_k", self.top_k, top_k_allowed)
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _check_float("min_p", self.min_p, "in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise _out_of_range("min_p", self.min_p, "in [0, 1]")

        # bounded so that logits scaled by it stay finite and non-zero in float32
        rep_allowed = "in [0.0001, 10000]"
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty, rep_allowed)
        if not 1e-4 <= self.repetition_penalty <= 1e4:
            raise _out_of_range("repetition_penalty", self.repetition_penalty, rep_allowed)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name), "in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise _out_of_range(name, value, "in [-2, 2]")
            setattr(self, name, value)

        if self.seed == -1 and not isinstance(self.seed, bool):    # vLLM's "no seed"
            self.seed = None
        if self.seed is not None:   # 64 bits, signed or unsigned, as vLLM takes (torch maps negatives)
            self.seed = _check_int("seed", self.seed, "in [-2**63, 2**64)")
            if not -_SEED_LIMIT <= self.seed < 2 * _SEED_LIMIT:
                raise _out_of_range("seed", self.seed, "in [-2**63, 2**64)")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)

        min_tokens_allowed = f"in [0, max_tokens={self.max_tokens}]"
        self.min_tokens = _check_int("min_tokens", self.min_tokens, min_tokens_allowed)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise _out_of_range("min_tokens", self.min_tokens, min_tokens_allowed)

        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is True:       # vLLM's: the sampled (prompt) token's logprob and one alternative
                value = 1
            if value is not None:
                logprobs_allowed = f"None or in [0, {MAX_LOGPROBS}]"
                value = _check_int(name, value, logprobs_allowed)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise _out_of_range(name, value, logprobs_allowed)
                setattr(self, name, value)

        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _check_bool("spaces_between_special_tokens",
                                                         self.spaces_between_special_tokens)
        if _check_bool("detokenize", self.detokenize) is not True:
            raise SamplingParamsError("detokenize=False (token ids without text) is not supported; leave it True")
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = self._normalise_token_ids("allowed_token_ids", self.allowed_token_ids,
                                            "None or a non-empty list of int >= 0")
            self.allowed_token_ids = list(dict.fromkeys(ids))      # each once: at most the vocabulary
            if not self.allowed_token_ids:
                raise _out_of_range("allowed_token_ids", [], "None or a non-empty list of int >= 0")
        self.bad_words = self._normalise_bad_words(self.bad_words)

    @staticmethod
    def _normalise_bad_words(words: object) -> list[str]:
        allowed = f"None or a list of at most {MAX_BAD_WORDS} non-blank str"
        if words is None:
            return []
        if not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS:
            raise _out_of_range("bad_words", words, allowed)
        for word in words:
            if not isinstance(word, str) or not word.strip():
                raise SamplingParamsError(f"bad_words must be {allowed}, got element {word!r}")
        return list(words)

    @staticmethod
    def _normalise_logit_bias(bias: object) -> dict[int, float]:
        """Token ids as ints (OpenAI's JSON sends them as strings: {"50256": -100})."""
        allowed = f"a map of token id (int >= 0, or its decimal string) to a number in [-{MAX_LOGIT_BIAS:g}, " \
                  f"{MAX_LOGIT_BIAS:g}]"
        if bias is None:
            return {}
        if not isinstance(bias, dict):
            raise _out_of_range("logit_bias", bias, allowed)
        out: dict[int, float] = {}
        for key, value in bias.items():
            shown = f"{key[:20]!r}... ({len(key)} characters)" if isinstance(key, str) and len(key) > 40 \
                else repr(key)
            decimal = isinstance(key, str) and key.isascii() and key.isdecimal()
            # past any vocabulary (int() also refuses 4,300 digits, leading zeros included)
            if decimal and (len(key.lstrip("0")) >= 20 or len(key) > 64):
                raise SamplingParamsError(f"logit_bias token id {shown} is past any vocabulary")
            token = int(key) if decimal else key
            if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
                raise SamplingParamsError(f"logit_bias must be {allowed}, got key {shown}")
            value = _check_float("logit_bias", value, f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(f"logit_bias must be {allowed}, got {value!r} for token {key!r}")
            out[int(token)] = value
        return out

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        allowed = "None, a non-empty str or a list of non-empty str"
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise _out_of_range("stop", stop, allowed)
        for s in stop:
            # An empty stop string would match at every position and end generation at once.
            if not isinstance(s, str) or not s:
                raise SamplingParamsError(f"stop must be {allowed}, got element {s!r}")
        return list(stop)  # a copy: the caller's list stays theirs

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        return SamplingParams._normalise_token_ids("stop_token_ids", ids, "None or a list of int >= 0")

    @staticmethod
    def _normalise_token_ids(name: str, ids: object, allowed: str) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise _out_of_range(name, ids, allowed)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, numbers.Integral) or i < 0:
                raise SamplingParamsError(f"{name} must be {allowed}, got element {i!r}")
        return [int(i) for i in ids]

    @property
    def is_greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE

    def validate_against_vocab(self, vocab_size: int) -> None:
        """Raise SamplingParamsError unless every token id a field names (stop_token_ids,
        logit_bias, allowed_token_ids) is in [0, vocab_size)."""
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            for token_id in ids:
                if token_id >= vocab_size:
                    raise SamplingParamsError(f"{name} contains {token_id}, must be in [0, {vocab_size})")
