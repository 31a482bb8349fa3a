"""The prompts a load test sends: random, ShareGPT and shared-prefix datasets.

Every builder returns a list of SampleRequest and needs a HuggingFace-style
tokenizer (`encode(text, add_special_tokens=False) -> list[int]`, `decode(ids)`,
`len(tokenizer)`, `all_special_ids`): prompt lengths are counted in tokens, as
in `vllm bench serve`: random and ShareGPT prompts' lengths include the
special tokens a completions server adds (a BOS), the shared-prefix
dataset's leave them out (prefix + suffix, as vLLM's prefix_repetition), and
none include a chat template's tokens. Builders are deterministic for a
given seed and draw from a private random generator, never the global one.

- random: prompts of random token ids (non-special ones that decode to whole
  characters), decoded to text and re-encoded until the text is exactly the
  wanted number of tokens (a few round trips; should they not hit the length,
  the measured length is recorded). Lengths are uniform integers in
  [floor(len * (1 - r)), ceil(len * (1 + r))] for range ratio r in [0, 1),
  as vLLM's RandomDataset.
- sharegpt: the public ShareGPT JSON format (a list of {"conversations":
  [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}),
  read from a local file: the first turn is the prompt, the second turn's
  token count the output length (unless fixed). Entries are shuffled with the
  seed; conversations with fewer than two turns, prompts or answers shorter
  than 4 tokens, prompts over 1,024 tokens, pairs over 2,048 (vLLM's caps, so
  a seed picks the requests `vllm bench serve` picks) and pairs that do not fit
  the context window are skipped; the rest are reused in order when fewer than
  asked for remain.
- prefix: `num_prefixes` long random prefixes shared by many prompts, each
  followed by a short random suffix (vLLM's "prefix_repetition"); it
  exercises prefix caching.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Round trips allowed to bring a random text to its exact token length; two or
# three are enough for byte-level BPE vocabularies in practice.
_MAX_ROUND_TRIPS = 10
# vLLM's ShareGPT filter: shorter prompts or answers make no meaningful request.
_MIN_SHAREGPT_TOKENS = 4
# vLLM's ShareGPT caps (its is_valid_sequence): a longer prompt, or a longer prompt + answer, is skipped
_MAX_SHAREGPT_PROMPT_TOKENS = 1024
_MAX_SHAREGPT_TOTAL_TOKENS = 2048


@dataclass(frozen=True)
class SampleRequest:
    """One request to send.

    `prompt` is the text: the completion prompt, or for /v1/chat/completions the
    content of a single user message. `prompt_len` counts its tokens by the
    benchmark's tokenizer; `expected_output_len` is sent as max_tokens.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int


class DatasetError(ValueError):
    """A dataset cannot be built from the given options; the message says what to change."""


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of lengths around `length` for `range_ratio` (vLLM's semantics)."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return low, high


def _allowed_ids(tokenizer: Any) -> list[int]:
    """Non-special ids that decode alone to whole characters.

    Byte-level pieces of a multi-byte character decode to U+FFFD, which
    re-encodes to several tokens; leaving them out is what lets the round trip
    in random_text reach exact lengths (vLLM samples from every non-special id
    and gets lengths that drift instead).
    """
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    candidates = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in candidates])
    allowed = [i for i, text in zip(candidates, texts, strict=True) if text and "\ufffd" not in text]
    if not allowed:
        allowed = candidates  # an unusual vocabulary: accept drifting lengths over no prompts
    if not allowed:
        raise DatasetError("the tokenizer has no non-special tokens to build random prompts from")
    return allowed


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _num_tokens(tokenizer: Any, text: str) -> int:
    """The tokens `text` is as a prompt: with the tokenizer's special tokens (a BOS), which a
    completions server adds and `vllm bench serve` counts."""
    return len(tokenizer.encode(text, add_special_tokens=True))


def num_special_tokens(tokenizer: Any) -> int:
    """The special tokens the tokenizer adds to a prompt (1 for a BOS)."""
    return len(tokenizer.encode("", add_special_tokens=True))


def random_text(tokenizer: Any, rng: random.Random, allowed: list[int], length: int) -> tuple[str, int]:
    """Random text of `length` tokens when reachable; returns (text, its measured token count)."""
    ids = [rng.choice(allowed) for _ in range(length)]
    for _ in range(_MAX_ROUND_TRIPS):
        # Decoding and re-encoding merges or splits tokens (byte-level pieces that
        # do not form whole characters), so the length is corrected and retried.
        text = tokenizer.decode(ids)
        ids = _encode(tokenizer, text)
        if len(ids) == length:
            return text, length
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids += [rng.choice(allowed) for _ in range(length - len(ids))]
    text = tokenizer.decode(ids)
    return text, len(_encode(tokenizer, text))


def random_dataset(tokenizer: Any, *, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                   lengths_seed: int | None = None) -> list[SampleRequest]:
    """`num_prompts` random prompts; a `prefix_len`-token random prefix is shared by all of them.
    With `lengths_seed` the lengths are drawn from it and only the text from `seed`: datasets
    of one `lengths_seed` have the same lengths, in the same order, and different prompts."""
    _check_positive({"--num-prompts": num_prompts, "--random-input-len": input_len,
                     "--random-output-len": output_len})
    if prefix_len < 0:
        raise DatasetError(f"--random-prefix-len must be >= 0, got {prefix_len}")
    in_low, in_high = length_range(input_len, range_ratio)
    out_low, out_high = length_range(output_len, range_ratio)
    rng = random.Random(seed)
    lengths = rng if lengths_seed is None else random.Random(lengths_seed)
    allowed = _allowed_ids(tokenizer)
    prefix = random_text(tokenizer, rng, allowed, prefix_len)[0] if prefix_len else ""
    special = num_special_tokens(tokenizer)
    requests = []
    for _ in range(num_prompts):
        # the prompt's special tokens (a BOS) count towards its length, as vLLM's RandomDataset counts them
        length = max(1, lengths.randint(in_low, in_high) - special)
        body, _ = random_text(tokenizer, rng, allowed, length)
        prompt = prefix + body
        requests.append(SampleRequest(prompt, _num_tokens(tokenizer, prompt), lengths.randint(out_low, out_high)))
    return requests


def prefix_dataset(tokenizer: Any, *, num_prompts: int, prefix_len: int, suffix_len: int,
                   num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """Prompts made of one of `num_prefixes` shared prefixes plus a unique suffix, shuffled."""
    _check_positive({"--num-prompts": num_prompts, "--prefix-repetition-prefix-len": prefix_len,
                     "--prefix-repetition-suffix-len": suffix_len,
                     "--prefix-repetition-num-prefixes": num_prefixes,
                     "--prefix-repetition-output-len": output_len})
    rng = random.Random(seed)
    allowed = _allowed_ids(tokenizer)
    prefixes = [random_text(tokenizer, rng, allowed, prefix_len)[0] for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        prompt = prefixes[i % num_prefixes] + random_text(tokenizer, rng, allowed, suffix_len)[0]
        requests.append(SampleRequest(prompt, len(_encode(tokenizer, prompt)), output_len))
    rng.shuffle(requests)
    return requests


def sharegpt_dataset(tokenizer: Any, path: str | Path, *, num_prompts: int, output_len: int | None = None,
                     max_model_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """Requests from a ShareGPT-format JSON file; `output_len` fixes every output length."""
    _check_positive({"--num-prompts": num_prompts})
    if output_len is not None and output_len < 1:
        raise DatasetError(f"--sharegpt-output-len must be >= 1, got {output_len}")
    entries = _read_sharegpt(Path(path))
    random.Random(seed).shuffle(entries)
    usable = []
    for prompt, answer in entries:
        # measured with the special tokens, as vLLM's ShareGPT dataset measures both turns
        prompt_len = _num_tokens(tokenizer, prompt)
        out_len = output_len if output_len is not None else _num_tokens(tokenizer, answer)
        if prompt_len < _MIN_SHAREGPT_TOKENS or (output_len is None and out_len < _MIN_SHAREGPT_TOKENS):
            continue
        if prompt_len > _MAX_SHAREGPT_PROMPT_TOKENS or prompt_len + out_len > _MAX_SHAREGPT_TOTAL_TOKENS:
            continue
        if max_model_len is not None and prompt_len + out_len > max_model_len:   # (prompt_len has the BOS)
            continue
        usable.append(SampleRequest(prompt, prompt_len, out_len))
        if len(usable) == num_prompts:
            break
    if not usable:
        raise DatasetError(f"{path}: no usable conversation (each needs two turns of at least "
                           f"{_MIN_SHAREGPT_TOKENS} tokens, a prompt of at most {_MAX_SHAREGPT_PROMPT_TOKENS} and "
                           f"at most {_MAX_SHAREGPT_TOTAL_TOKENS} in all, that fit the context window)")
    return [usable[i % len(usable)] for i in range(num_prompts)]


def _read_sharegpt(path: Path) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two text turns."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise DatasetError(f"--dataset-path {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise DatasetError(f"--dataset-path {path} is not JSON: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(f"--dataset-path {path}: expected a JSON list of ShareGPT entries "
                           '({"conversations": [{"from": ..., "value": ...}, ...]})')
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        if all(isinstance(t, str) for t in texts):
            pairs.append((texts[0], texts[1]))
    return pairs


def _check_positive(values: dict[str, int]) -> None:
    """`values` maps the command-line flag that set a value to the value."""
    for flag, value in values.items():
        if value < 1:
            raise DatasetError(f"{flag} must be >= 1, got {value}")
