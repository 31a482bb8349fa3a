"""Batched next-token sampling: penalties, temperature, top-k/top-p/min-p, seeded draws.

Per row, in vLLM v1's order: allowed tokens -> logit bias -> banned tokens -> repetition
penalty -> presence/frequency penalties -> temperature -> min-p -> top-k -> top-p ->
sample; each mask acts on the
distribution the previous ones left, renormalised (top-p measures the mass of the
tokens min-p and top-k kept). Greedy rows take the argmax right after the penalties.
Everything is computed in float32 on the logits' device. The masking steps are pure
functions (new tensor out, input untouched) that take per-row parameters as a Python
scalar or sequence, so deciding what to skip never needs a device sync.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.model.attention_metadata import to_device
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

# logits scored per block on a CPU (score_tokens): 1 MiB of float32, which stays in cache
SCORE_BLOCK_ELEMENTS = 1 << 18
# top_p is compared against float32 cumulative sums whose rounding error is ~1e-7;
# the slack makes "mass above this token already reaches top_p" hold when the two
# are equal in exact arithmetic (0.5 + 0.3 vs top_p=0.8).
_TOP_P_SLACK = 1e-6


@dataclass(slots=True)
class SamplingRow:
    """One sequence's view for this step."""

    params: SamplingParams
    prompt_token_ids: list[int]         # empty unless repetition_penalty is used
    output_token_ids: list[int]         # generated so far, before this step; empty unless a penalty is used
    # Per-request generator seeded from params.seed, living as long as the request and
    # on the logits' device; None = draw from the sampler's batch generator.
    generator: torch.Generator | None = None
    # Forced to -inf this step (e.g. EOS and stop_token_ids while under min_tokens).
    banned_token_ids: list[int] = field(default_factory=list)

    @property
    def reads_nothing_from_host(self) -> bool:
        """True when sampling this row needs no token history and returns no
        logprobs: its token can stay on the device until the host wants it."""
        p = self.params
        return (p.logprobs is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
                and p.frequency_penalty == 0.0 and not p.bad_words)


@dataclass(slots=True)
class TokenLogprobs:
    """The model's (raw-logit) log-probabilities around one sampled token."""

    token_id: int
    logprob: float
    rank: int                           # 1 + number of tokens with a strictly larger raw logit
    top: list[tuple[int, float]]        # params.logprobs best (token_id, logprob), best first


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]                # one per row
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


# ---------------------------------------------------------------------------
# Pure masking / penalty steps
# ---------------------------------------------------------------------------

def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.tensor(values) on `device`, copied through pinned memory so that the
    host does not wait for the work already queued there (async scheduling)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _row_values(value: float | Sequence[float], num_rows: int) -> list:
    if isinstance(value, (int, float)):
        return [value] * num_rows
    if len(value) != num_rows:
        raise ValueError(f"expected {num_rows} per-row values, got {len(value)}")
    return list(value)


def _row_col_index(token_ids: Sequence[Sequence[int]], vocab_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, col) index tensors addressing every listed token; None if there are none."""
    # Filling an int64 array and wrapping its buffer is several times faster than
    # torch.tensor() on a Python list, which matters at ~100k penalty tokens per step.
    flat = array.array("q")
    lengths = []
    for ids in token_ids:
        flat.extend(ids)
        lengths.append(len(ids))
    if not flat:
        return None
    cols = torch.frombuffer(flat, dtype=torch.int64)
    lo, hi = (int(v) for v in torch.aminmax(cols))
    # Checked here because a negative id would otherwise silently index from the end.
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token ids must be in [0, {vocab_size}), got min {lo}, max {hi}")
    rows = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    # through pinned memory: a plain copy to a GPU would wait for the work queued there
    return to_device(rows, torch.device(device)), to_device(cols, torch.device(device))


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """How often each token id occurs in each row's list."""
    # returns: [len(token_ids), vocab_size] float32
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    index = _row_col_index(token_ids, vocab_size, counts.device)
    if index is not None:
        # Adding 1.0s is exact in float32, so accumulation order cannot change the result.
        counts.index_put_(index, torch.ones(index[0].numel(), dtype=counts.dtype, device=counts.device),
                          accumulate=True)
    return counts


def apply_allowed_tokens(logits: torch.Tensor, allowed_token_ids: Sequence[Sequence[int] | None]) -> torch.Tensor:
    """Every token but a row's allowed ones to -inf (None: the row allows all)."""
    # logits: [num_rows, vocab_size] float32
    rows = [(i, ids) for i, ids in enumerate(allowed_token_ids) if ids is not None]
    keep = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)
    r, c = _row_col_index([ids for _, ids in rows], logits.shape[-1], logits.device)
    keep[r, c] = True
    masked = logits.clone()
    idx = _on_device([i for i, _ in rows], torch.long, logits.device)
    masked[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    return masked


def apply_logit_bias(logits: torch.Tensor, logit_bias: Sequence[dict[int, float]]) -> torch.Tensor:
    """Each row's biases added to their tokens' logits."""
    # logits: [num_rows, vocab_size] float32
    rows, cols, values = [], [], []
    for i, bias in enumerate(logit_bias):
        rows.extend([i] * len(bias))
        cols.extend(bias)
        values.extend(bias.values())
    out = logits.clone()
    out.index_put_((_on_device(rows, torch.long, logits.device), _on_device(cols, torch.long, logits.device)),
                   _on_device(values, logits.dtype, logits.device), accumulate=True)
    return out


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """Set each row's banned ids to -inf."""
    # logits: [num_rows, vocab_size] -> same shape
    index = _row_col_index(banned_token_ids, logits.shape[-1], logits.device)
    if index is None:
        return logits.clone()
    return logits.index_put(index, logits.new_full((), float("-inf")))   # made on the device, no copy


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: float | Sequence[float]) -> torch.Tensor:
    """Where seen: logit > 0 -> logit / r, else logit * r (r = 1 leaves the row unchanged)."""
    # logits: [num_rows, vocab_size] float32; seen: [num_rows, vocab_size] bool
    r = torch.tensor(_row_values(penalty, logits.shape[0]), dtype=logits.dtype,
                     device=logits.device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / r, logits * r)
    return torch.where(seen, penalised, logits)


def apply_presence_frequency_penalties(logits: torch.Tensor, counts: torch.Tensor,
                                       presence_penalty: float | Sequence[float],
                                       frequency_penalty: float | Sequence[float]) -> torch.Tensor:
    """logit -= frequency * count + presence * (count > 0)."""
    # logits: [num_rows, vocab_size] float32; counts: [num_rows, vocab_size] (output tokens only)
    n = logits.shape[0]
    presence = torch.tensor(_row_values(presence_penalty, n), dtype=logits.dtype,
                            device=logits.device).unsqueeze(1)
    frequency = torch.tensor(_row_values(frequency_penalty, n), dtype=logits.dtype,
                             device=logits.device).unsqueeze(1)
    return logits - (frequency * counts + presence * (counts > 0))


def apply_penalties(logits: torch.Tensor,
                    prompt_token_ids: Sequence[Sequence[int]],
                    output_token_ids: Sequence[Sequence[int]],
                    repetition_penalty: float | Sequence[float] = 1.0,
                    presence_penalty: float | Sequence[float] = 0.0,
                    frequency_penalty: float | Sequence[float] = 0.0) -> torch.Tensor:
    """Repetition penalty over prompt+output tokens, then presence/frequency over output tokens.

    Steps whose parameters are neutral for every row are skipped.
    """
    # logits: [num_rows, vocab_size] float32 -> same shape
    n, vocab_size = logits.shape
    rep = _row_values(repetition_penalty, n)
    presence = _row_values(presence_penalty, n)
    frequency = _row_values(frequency_penalty, n)
    use_rep = any(r != 1.0 for r in rep)
    use_pf = any(p != 0.0 for p in presence) or any(f != 0.0 for f in frequency)
    if not (use_rep or use_pf):
        return logits.clone()
    counts = token_counts(output_token_ids, vocab_size, logits.device)
    if use_rep:
        seen = torch.zeros(n, vocab_size, dtype=torch.bool, device=logits.device)
        index = _row_col_index(prompt_token_ids, vocab_size, logits.device)
        if index is not None:
            seen.index_put_(index, torch.tensor(True, device=logits.device))
        logits = apply_repetition_penalty(logits, seen | (counts > 0), rep)
    if use_pf:
        logits = apply_presence_frequency_penalties(logits, counts, presence, frequency)
    return logits


def apply_temperature(logits: torch.Tensor, temperature: float | Sequence[float]) -> torch.Tensor:
    """logits / T per row (T > 0)."""
    # logits: [num_rows, vocab_size] -> same shape
    t = _on_device(_row_values(temperature, logits.shape[0]), logits.dtype, logits.device)
    return logits / t.unsqueeze(1)


def apply_top_k(logits: torch.Tensor, k: int | Sequence[int]) -> torch.Tensor:
    """Keep each row's k largest logits; k = 0 disables the row, k >= vocab keeps all.

    Tokens tied with the k-th largest value are all kept, so more than k may survive.
    The kept set depends only on the values, never on token order or kernel choice.
    """
    # logits: [num_rows, vocab_size] -> same shape, dropped entries -inf
    n, vocab_size = logits.shape
    ks = [min(int(v), vocab_size) for v in _row_values(k, n)]
    max_k = max(ks, default=0)
    if max_k == 0:
        return logits.clone()
    top = logits.topk(max_k, dim=-1).values                            # [n, max_k] descending
    k_t = _on_device(ks, torch.long, logits.device).unsqueeze(1)
    kth = top.gather(1, (k_t - 1).clamp(min=0))                         # [n, 1]
    kth = kth.masked_fill(k_t == 0, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float | Sequence[float]) -> torch.Tensor:
    """Nucleus mask: keep a token iff the probability mass ranked strictly above it is < p.

    The top token is always kept; p >= 1 keeps every token. Tokens tied in probability
    with the last kept one are kept too (deterministic, order independent).
    """
    # logits: [num_rows, vocab_size] -> same shape, dropped entries -inf
    n = logits.shape[0]
    ps = _on_device(_row_values(p, n), torch.float32, logits.device)
    limit = torch.where(ps >= 1.0, float("inf"), ps - _TOP_P_SLACK).unsqueeze(1)
    probs = logits.float().softmax(dim=-1)
    sorted_probs = probs.sort(dim=-1, descending=True).values
    cum = sorted_probs.cumsum(dim=-1)
    mass_above = torch.nn.functional.pad(cum[:, :-1], (1, 0))          # exclusive prefix sums
    # mass_above is non-decreasing, so the kept tokens are a prefix of the sorted order.
    num_kept = (mass_above < limit).sum(dim=-1, keepdim=True).clamp(min=1)
    threshold = sorted_probs.gather(1, num_kept - 1)                    # smallest kept probability
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float | Sequence[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p * (the row's largest probability).

    Evaluated as logit < max_logit + log(min_p): the probability ratio does not depend
    on normalisation, so no softmax is needed. min_p = 0 keeps everything.
    """
    # logits: [num_rows, vocab_size] -> same shape, dropped entries -inf
    mp = _on_device(_row_values(min_p, logits.shape[0]), torch.float32, logits.device).unsqueeze(1)
    cutoff = logits.amax(dim=-1, keepdim=True) + mp.log()              # log(0) = -inf: no cutoff
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _own_noise(generator: torch.Generator, vocab_size: int, dtype: torch.dtype,
               device: torch.device) -> torch.Tensor:
    """One seeded row's draw for one token: [vocab_size] Exp(1) noise."""
    return torch.empty(vocab_size, dtype=dtype, device=device).exponential_(generator=generator)


def seeded_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, all of its 64 bits counting. torch's CPU
    generator keeps only the low 32 (seeds 7 and 7 + 2**40 drew the same tokens), so on CPU a
    seed outside [0, 2**32) (a negative one as its 64-bit two's complement) is hashed to 32 bits
    (SplitMix64's finaliser: neighbouring seeds, as a request's choices take, land far apart); a
    seed in [0, 2**32) seeds as it is."""
    device = torch.device(device)
    if device.type == "cpu" and not 0 <= seed < 1 << 32:
        mask = (1 << 64) - 1
        z = seed & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        seed = (z ^ (z >> 31)) & 0xFFFFFFFF
    return torch.Generator(device=device).manual_seed(seed)


def skip_draws(generator: torch.Generator, num_tokens: int, vocab_size: int) -> None:
    """Advances a request's own generator past `num_tokens` sampled tokens,
    exactly as sampling them would (one draw each, of the sampler's float32
    probabilities' width): a request continued elsewhere keeps its stream."""
    for _ in range(num_tokens):
        _own_noise(generator, vocab_size, torch.float32, generator.device)


def advanced_generator_state(seed: int, num_tokens: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The state of a request's generator (seeded with `seed`, on `device`) after
    `num_tokens` sampled tokens; for any thread (the draws release the GIL)."""
    generator = seeded_generator(seed, device)
    skip_draws(generator, num_tokens, vocab_size)
    return generator.get_state()


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None],
                      batch_generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw one token per row via the exponential race: argmax(probs / Exp(1) noise).

    A row with its own generator gets a fresh vocab-sized noise draw from it, so its
    token depends only on that generator and its probs, never on batch size or position.
    Rows without one share a single draw from batch_generator (None = torch default).
    """
    # probs: [num_rows, vocab_size] float32 -> token ids: [num_rows] int64
    n, vocab_size = probs.shape
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if not seeded:
        noise = torch.empty_like(probs).exponential_(generator=batch_generator)
    else:
        # Each seeded row draws into its own fresh tensor, so its stream cannot depend
        # on where the row sits in the batch.
        own = torch.stack([_own_noise(generators[i], vocab_size, probs.dtype, probs.device) for i in seeded])
        if len(seeded) == n:
            noise = own
        else:
            unseeded = [i for i, g in enumerate(generators) if g is None]
            noise = torch.empty_like(probs)
            noise[_on_device(seeded, torch.long, probs.device)] = own
            noise[_on_device(unseeded, torch.long, probs.device)] = torch.empty(
                len(unseeded), vocab_size, dtype=probs.dtype,
                device=probs.device).exponential_(generator=batch_generator)
    # An Exp(1) draw can be exactly 0; p / 0 would be inf (or NaN for p = 0, which
    # argmax would pick), so floor the noise at the smallest normal float.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def heaviest_rows(num_rows: int, vocab_size: int, device: torch.device) -> list[SamplingRow]:
    """Rows that take every allocating path of the sampler at once, for measuring
    its peak memory: allowed tokens, a logit bias, banned tokens, all three
    penalties, temperature, min-p, top-k over the whole vocabulary (a full sort),
    top-p, the most logprobs, and half the rows seeded beside half drawn from the
    batch generator (both noise tensors live at once)."""
    params = SamplingParams(temperature=0.8, top_k=vocab_size, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=MAX_LOGPROBS, max_tokens=2,
                            allowed_token_ids=[0, vocab_size - 1], logit_bias={0: 1.0})
    return [SamplingRow(params=params, prompt_token_ids=[0], output_token_ids=[1],
                        generator=torch.Generator(device=device).manual_seed(i) if i % 2 else None,
                        banned_token_ids=[2])
            for i in range(num_rows)]


# ---------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------

class Sampler:
    """Turns one step's logits into one token (and optional logprobs) per row."""

    def __init__(self, generator: torch.Generator | None = None):
        """generator: draws for rows without their own generator; None = torch default RNG."""
        self._generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleResult:
        """Sample one token per row; logits are not modified."""
        # logits: [num_rows, vocab_size], any float dtype; rows[i] describes logits[i]
        token_ids = self.sample(logits, rows)
        return SampleResult(token_ids=token_ids.tolist(),
                            logprobs=_gather_logprobs(logits, token_ids, [row.params for row in rows]))

    @staticmethod
    def _check_shape(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab_size], "
                             f"got {tuple(logits.shape)}")

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The sampled token ids [num_rows] int64, on the logits' device (nothing
        waits for the device: no logprobs here)."""
        self._check_shape(logits, rows)
        num_rows = len(rows)
        device = logits.device
        params = [row.params for row in rows]
        # Every step below is out-of-place, so aliasing float32 input here is safe.
        x = logits.float()

        if any(p.allowed_token_ids is not None for p in params):
            x = apply_allowed_tokens(x, [p.allowed_token_ids for p in params])
        if any(p.logit_bias for p in params):
            x = apply_logit_bias(x, [p.logit_bias for p in params])
        if any(row.banned_token_ids for row in rows):
            unbanned = x
            x = apply_banned_tokens(x, [row.banned_token_ids for row in rows])
            # a row whose bans took every token left (bad words of several tokens, or min_tokens,
            # against a short allowed_token_ids list) keeps its tokens: argmax and the draw would
            # otherwise give token 0, whatever was allowed (no host sync: a masked select)
            x = torch.where(torch.isneginf(x).all(dim=-1, keepdim=True), unbanned, x)

        rep = [p.repetition_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        use_rep = [r != 1.0 for r in rep]
        use_pf = [pr != 0.0 or fr != 0.0 for pr, fr in zip(presence, frequency)]
        if any(use_rep) or any(use_pf):
            # Only rows that use a penalty pay for turning their token lists into tensors.
            x = apply_penalties(
                x,
                [row.prompt_token_ids if u else () for row, u in zip(rows, use_rep)],
                [row.output_token_ids if (u or v) else () for row, u, v in zip(rows, use_rep, use_pf)],
                rep, presence, frequency)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            return x.argmax(dim=-1)
        random_idx = [i for i, g in enumerate(greedy) if not g]
        token_ids = self._sample(x, [rows[i] for i in random_idx], random_idx, num_rows)
        if any(greedy):
            token_ids = torch.where(_on_device(greedy, torch.bool, device), x.argmax(dim=-1), token_ids)
        return token_ids

    def _sample(self, x: torch.Tensor, rows: list[SamplingRow], idx: list[int],
                num_rows: int) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p and a draw for the non-greedy rows x[idx]."""
        # x: [num_rows, vocab_size] float32 -> [num_rows] int64 (entries outside idx are 0)
        subset = len(idx) < num_rows
        idx_t = _on_device(idx, torch.long, x.device) if subset else None
        xs = x[idx_t] if subset else x
        params = [row.params for row in rows]

        temperature = [p.temperature for p in params]
        if any(t != 1.0 for t in temperature):
            xs = apply_temperature(xs, temperature)
        min_p = [p.min_p for p in params]
        if any(min_p):
            xs = apply_min_p(xs, min_p)
        top_k = [p.top_k for p in params]
        if any(top_k):
            xs = apply_top_k(xs, top_k)
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            xs = apply_top_p(xs, top_p)

        sampled = sample_from_probs(xs.softmax(dim=-1), [row.generator for row in rows],
                                    self._generator)
        if not subset:
            return sampled
        out = torch.zeros(num_rows, dtype=torch.long, device=x.device)
        return out.index_copy_(0, idx_t, sampled)


def _gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor,
                     params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled tokens under the raw (unpenalised, untempered) logits."""
    # logits: [num_rows, vocab_size]; token_ids: [num_rows] int64
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return result
    idx = torch.tensor(wanted, device=logits.device)
    scores = score_tokens(logits.index_select(0, idx), token_ids.index_select(0, idx),
                          max(params[i].logprobs for i in wanted))
    for i, entry in zip(wanted, scores.entries([params[i].logprobs for i in wanted])):
        result[i] = entry
    return result


@dataclass(slots=True)
class TokenScores:
    """Given tokens' log-probabilities under raw logits, per row, on the host."""
    token_ids: list[int]                 # [R]
    logprobs: list[float]                # [R]
    ranks: list[int]                     # [R] 1 + tokens with a strictly larger raw logit
    top_ids: list[list[int]]             # [R][top_n] best first
    top_logprobs: list[list[float]]      # [R][top_n]

    def entries(self, top_n: Sequence[int], start: int = 0) -> list[TokenLogprobs]:
        """One TokenLogprobs for each of rows start, start + 1, ..., len(top_n) of
        them, row start + i with its top_n[i] best alternatives."""
        return [TokenLogprobs(token_id=self.token_ids[r], logprob=self.logprobs[r], rank=self.ranks[r],
                              top=list(zip(self.top_ids[r][:n], self.top_logprobs[r][:n])) if n else [])
                for r, n in zip(range(start, start + len(top_n)), top_n)]

    def extend(self, other: "TokenScores") -> None:
        for name in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"):
            getattr(self, name).extend(getattr(other, name))


def score_tokens(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> TokenScores:
    """The log-probability and rank of token_ids[i] under the raw logits of row i,
    and each row's `top_n` best tokens (read back to the host). On a CPU the rows
    go SCORE_BLOCK_ELEMENTS at a time: each block's passes (softmax, ranks, best
    tokens) then read it from cache, not memory (2-3x faster at 8k-128k vocabularies)."""
    # logits: [R, vocab_size] any float dtype; token_ids: [R] int64 on the same device
    rows = logits.shape[0]
    block = max(1, SCORE_BLOCK_ELEMENTS // logits.shape[1]) if logits.device.type == "cpu" else max(rows, 1)
    scores = TokenScores([], [], [], [], [])
    for start in range(0, rows, block):
        scores.extend(_score_block(logits[start:start + block], token_ids[start:start + block], top_n))
    return scores


def _score_block(logits: torch.Tensor, token_ids: torch.Tensor, top_n: int) -> TokenScores:
    raw = logits.float()
    logprobs = raw.log_softmax(dim=-1)
    chosen = token_ids.unsqueeze(1)                                     # [R, 1]
    chosen_logprob = logprobs.gather(1, chosen).squeeze(1)
    # Rank by raw logit so tokens tied in logit share a rank, whatever log_softmax rounds to
    # (an int32 sum: an int64 one is twice as slow on a CPU).
    rank = (raw > raw.gather(1, chosen)).sum(dim=-1, dtype=torch.int32) + 1
    top_ids: list[list[int]] = [[] for _ in range(raw.shape[0])]
    top_values: list[list[float]] = [[] for _ in range(raw.shape[0])]
    if top_n:
        best = logprobs.max(dim=-1, keepdim=True) if top_n == 1 else \
            logprobs.topk(min(top_n, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = best.values.tolist(), best.indices.tolist()
    return TokenScores(token_ids.tolist(), chosen_logprob.tolist(), rank.tolist(), top_ids, top_values)
