"""Sampler: masks, penalties, greedy, seeded reproducibility, distribution, logprobs."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.sampler import (
    Sampler,
    SamplingRow,
    apply_banned_tokens,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    token_counts,
)
from engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def row(prompt=(), output=(), generator=None, banned=(), **params) -> SamplingRow:
    return SamplingRow(params=SamplingParams(**params), prompt_token_ids=list(prompt),
                       output_token_ids=list(output), generator=generator,
                       banned_token_ids=list(banned))


def kept(masked: torch.Tensor) -> list[set[int]]:
    """Per row, the token ids that survived a mask."""
    return [set(torch.nonzero(r != NEG_INF).flatten().tolist()) for r in masked]


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([probs]).log()


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- masks

def test_bans_that_take_every_allowed_token_leave_the_allowed_ones():
    """A bad word of two tokens can ban the only tokens allowed_token_ids leaves: the row
    is then sampled from the allowed tokens, not as all -inf (argmax and the draw gave 0)."""
    logits = torch.tensor([[5.0, 1.0, 2.0, 3.0, 0.5]] * 3)
    rows = [row(allowed_token_ids=[2, 3], banned=[2, 3], temperature=0.0),
            row(allowed_token_ids=[2, 3], banned=[2, 3], temperature=1.0, seed=7, generator=gen(7)),
            row(allowed_token_ids=[2, 3], banned=[3], temperature=0.0)]      # a ban that leaves a token holds
    tokens = Sampler(gen(0)).sample(logits, rows).tolist()
    assert tokens[0] == 3 and tokens[1] in (2, 3) and tokens[2] == 2
    drawn = {Sampler(gen(0)).sample(logits[1:2], [row(allowed_token_ids=[2, 3], banned=[2, 3], temperature=1.0,
                                                       seed=s, generator=gen(s))]).item() for s in range(40)}
    assert drawn == {2, 3}


def test_top_k_keeps_exactly_the_k_largest_and_their_values():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.5]] * 4)
    out = apply_top_k(logits, [1, 2, 3, 0])
    assert kept(out) == [{1}, {1, 4}, {1, 2, 4}, {0, 1, 2, 3, 4}]
    # Surviving logits are untouched, not renormalised.
    assert out[2].tolist() == [NEG_INF, 3.0, 2.0, NEG_INF, 2.5]


def test_top_k_larger_than_vocab_keeps_all():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert kept(apply_top_k(logits, 10)) == [{0, 1, 2}]


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0], [2.0, 2.0, 2.0, 1.0]])
    assert kept(apply_top_k(logits, [2, 1])) == [{0, 1, 2}, {0, 1, 2}]


def test_top_k_ignores_tokens_already_masked():
    logits = torch.tensor([[NEG_INF, 3.0, NEG_INF, 1.0]])
    assert kept(apply_top_k(logits, 3)) == [{1, 3}]


@pytest.mark.parametrize("p, expected", [
    (0.3, {0}),
    (0.5, {0}),            # mass above token 1 is 0.5, not < 0.5
    (0.51, {0, 1}),
    (0.8, {0, 1}),         # mass above token 2 is exactly 0.8
    (0.81, {0, 1, 2}),
    (0.95, {0, 1, 2}),
    (0.96, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_tokens_whose_mass_above_is_below_p(p, expected):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert kept(apply_top_p(logits, p)) == [expected]


def test_top_p_exact_decimal_boundary_survives_float_rounding():
    # 0.45 + 0.35 == 0.8 in real arithmetic; in float32 the sum lands just below 0.8.
    assert kept(apply_top_p(log_probs(0.45, 0.35, 0.2), 0.8)) == [{0, 1}]


def test_top_p_per_row_values_and_unsorted_vocab():
    # Same distribution, shuffled ids: the mask follows probability, not position.
    logits = torch.cat([log_probs(0.15, 0.5, 0.05, 0.3), log_probs(0.15, 0.5, 0.05, 0.3)])
    assert kept(apply_top_p(logits, [0.6, 0.9])) == [{1, 3}, {0, 1, 3}]


def test_top_p_keeps_ties_with_last_kept_token():
    # Sorted mass above: 0, 0.4, 0.6, 0.8 -> two tokens needed, the other 0.2s tie with the second.
    logits = log_probs(0.4, 0.2, 0.2, 0.2)
    assert kept(apply_top_p(logits, 0.5)) == [{0, 1, 2, 3}]


def test_top_p_renormalises_over_tokens_already_masked():
    # After dropping token 0 the rest is 0.6/0.4 -> with p=0.55 only token 1 stays.
    logits = log_probs(0.5, 0.3, 0.2)
    logits[0, 0] = NEG_INF
    assert kept(apply_top_p(logits, 0.55)) == [{1}]


@pytest.mark.parametrize("min_p, expected", [
    (0.0, {0, 1, 2, 3}),
    (0.09, {0, 1, 2, 3}),   # cutoff 0.045 < 0.05
    (0.2, {0, 1, 2}),       # cutoff 0.10
    (0.5, {0, 1}),          # cutoff 0.25
    (0.61, {0}),            # cutoff 0.305
    (1.0, {0}),
])
def test_min_p_relative_to_max_probability(min_p, expected):
    logits = log_probs(0.5, 0.3, 0.15, 0.05)
    assert kept(apply_min_p(logits, min_p)) == [expected]


def test_min_p_per_row():
    logits = torch.cat([log_probs(0.5, 0.3, 0.15, 0.05)] * 2)
    assert kept(apply_min_p(logits, [0.5, 0.0])) == [{0, 1}, {0, 1, 2, 3}]


def test_top_k_then_top_p_differs_from_reverse_order():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # top-k=2 renormalises to 4/7, 3/7; then top-p=0.5 keeps only the first.
    assert kept(apply_top_p(apply_top_k(logits, 2), 0.5)) == [{0}]
    # The other way round would keep two tokens.
    assert kept(apply_top_k(apply_top_p(logits, 0.5), 2)) == [{0, 1}]


def test_top_p_then_min_p_differs_from_reverse_order():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # top-p=0.75 keeps 3 (mass above: 0, .4, .7); min-p=0.4 cuts below 0.16 -> still 3.
    assert kept(apply_min_p(apply_top_p(logits, 0.75), 0.4)) == [{0, 1, 2}]
    # min-p first leaves .44/.33/.22; top-p then stops after two tokens.
    assert kept(apply_top_p(apply_min_p(logits, 0.4), 0.75)) == [{0, 1}]


def test_masks_do_not_modify_their_input():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    before = logits.clone()
    apply_top_k(logits, 1), apply_top_p(logits, 0.1), apply_min_p(logits, 0.9)
    apply_banned_tokens(logits, [[0]])
    apply_penalties(logits, [[0]], [[1]], 2.0, 1.0, 1.0)
    assert torch.equal(logits, before)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-20, 20), min_size=2, max_size=40), st.floats(0.01, 1.0))
def test_top_p_keeps_the_smallest_sufficient_head(values, p):
    logits = torch.tensor([values], dtype=torch.float32)
    probs = logits.softmax(-1)[0]
    keep = kept(apply_top_p(logits, p))[0]
    smallest_kept = probs[list(keep)].min()
    # A probability threshold: everything at least as likely as a kept token is kept.
    assert keep == set(torch.nonzero(probs >= smallest_kept).flatten().tolist())
    # Without the least likely kept token(s) the head would not reach p ...
    assert probs[probs > smallest_kept].double().sum().item() < p + 1e-5
    # ... and whenever something is dropped, the head does reach p.
    if len(keep) < len(values):
        assert probs[list(keep)].double().sum().item() >= p - 1e-5


# --------------------------------------------------------------------------- penalties

def test_token_counts():
    counts = token_counts([[1, 2, 2], [], [0, 0, 0]], 4)
    assert counts.tolist() == [[0, 1, 2, 0], [0, 0, 0, 0], [3, 0, 0, 0]]


def test_penalties_match_formula_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]] * 2)
    prompt = [[0, 1], [0, 1]]
    output = [[1, 2, 2], [1, 2, 2]]
    out = apply_penalties(logits, prompt, output,
                          repetition_penalty=[2.0, 1.0],
                          presence_penalty=[0.5, 0.0],
                          frequency_penalty=[0.25, 0.0])
    expected = [
        2.0 / 2,                        # prompt only, positive: divided; no output penalties
        -1.0 * 2 - 0.25 * 1 - 0.5,      # prompt and output, negative: multiplied; count 1
        0.5 / 2 - 0.25 * 2 - 0.5,       # output only, count 2
        -0.5,                           # never seen
        3.0,                            # never seen
    ]
    assert out[0].tolist() == pytest.approx(expected)
    assert out[1].tolist() == [2.0, -1.0, 0.5, -0.5, 3.0]   # neutral row untouched


def test_negative_presence_and_frequency_raise_logits():
    logits = torch.tensor([[0.0, 0.0, 0.0]])
    out = apply_penalties(logits, [[0]], [[1, 1, 1]], presence_penalty=-1.0, frequency_penalty=-0.5)
    assert out[0].tolist() == pytest.approx([0.0, 1.0 + 1.5, 0.0])


def test_repetition_penalty_below_one_boosts():
    logits = torch.tensor([[2.0, -2.0, 1.0]])
    out = apply_penalties(logits, [[0, 1]], [[]], repetition_penalty=0.5)
    assert out[0].tolist() == pytest.approx([4.0, -1.0, 1.0])


def test_out_of_range_token_ids_rejected():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        apply_penalties(torch.zeros(1, 3), [[-1]], [[]], repetition_penalty=2.0)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        apply_banned_tokens(torch.zeros(1, 3), [[3]])


def test_penalties_change_greedy_choice_through_sampler():
    logits = torch.tensor([[3.0, 2.9, 1.0], [3.0, 2.9, 1.0], [3.0, 2.9, 1.0]])
    rows = [row(temperature=0),
            row(prompt=[0], temperature=0, repetition_penalty=1.1),   # 3.0/1.1 < 2.9
            row(output=[0, 0], temperature=0, frequency_penalty=0.1)]  # 3.0 - 0.2 < 2.9
    assert Sampler()(logits, rows).token_ids == [0, 1, 1]


def test_presence_penalty_ignores_prompt_tokens():
    logits = torch.tensor([[3.0, 2.9, 1.0]])
    result = Sampler()(logits, [row(prompt=[0], temperature=0, presence_penalty=2.0)])
    assert result.token_ids == [0]


# --------------------------------------------------------------------------- greedy and bans

def test_greedy_is_argmax_with_lowest_id_on_ties():
    logits = torch.tensor([[0.1, 5.0, 5.0, 4.0], [9.0, 1.0, 9.0, 9.0], [-3.0, -1.0, -2.0, -5.0]])
    rows = [row(temperature=0, top_k=1, top_p=0.1, min_p=0.9) for _ in range(3)]
    assert Sampler()(logits, rows).token_ids == [1, 0, 1]


def test_greedy_rows_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    rows = [row(temperature=0) if i % 2 else row(temperature=1.5, top_k=5) for i in range(6)]
    result = Sampler(gen(0))(logits, rows)
    argmax = logits.argmax(-1).tolist()
    assert [result.token_ids[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]
    top5 = logits.topk(5, dim=-1).indices.tolist()
    assert all(result.token_ids[i] in top5[i] for i in (0, 2, 4))


def test_banned_tokens_skip_greedy_winner():
    logits = torch.tensor([[1.0, 5.0, 4.0, 3.0]])
    assert Sampler()(logits, [row(temperature=0, banned=[1, 2])]).token_ids == [3]


def test_banned_tokens_never_sampled():
    logits = torch.tensor([[4.0, 1.0, 4.0, 1.0]]).repeat(5000, 1)
    rows = [row(banned=[0, 2])] * 2500 + [row(banned=[0, 2], generator=gen(i)) for i in range(2500)]
    tokens = Sampler(gen(1))(logits, rows).token_ids
    assert set(tokens) == {1, 3}


def test_logit_bias_moves_the_greedy_choice_and_the_distribution_per_row():
    logits = torch.tensor([[1.0, 5.0, 4.0, 3.0]]).repeat(3, 1)
    rows = [row(temperature=0, logit_bias={3: 2.5}), row(temperature=0, logit_bias={1: -1.5, 2: 0.25}),
            row(temperature=0)]
    assert Sampler()(logits, rows).token_ids == [3, 2, 1]
    # sampled: the bias is on the logits, so a +ln(3) bias makes a token 3x as likely
    flat = torch.zeros(20000, 2)
    tokens = Sampler(gen(2))(flat, [row(logit_bias={1: math.log(3)})] * 20000).token_ids
    assert abs(sum(tokens) / 20000 - 0.75) < 0.015
    assert Sampler()(logits[:1], [row(temperature=0, logit_bias={1: -100.0, 2: -100.0, 3: -100.0})]).token_ids == [0]


def test_allowed_token_ids_are_the_only_ones_sampled_and_leave_other_rows_alone():
    logits = torch.tensor([[4.0, 1.0, 4.0, 1.0, 9.0]]).repeat(4000, 1)
    rows = [row(allowed_token_ids=[1, 3]), row(), row(allowed_token_ids=[2], temperature=0),
            row(allowed_token_ids=[0, 1], temperature=0)] * 1000
    tokens = Sampler(gen(3))(logits, rows).token_ids
    assert set(tokens[0::4]) == {1, 3} and set(tokens[1::4]) <= {0, 2, 4} and 4 in tokens[1::4]
    assert set(tokens[2::4]) == {2} and set(tokens[3::4]) == {0}


def test_logits_not_modified_and_low_precision_accepted():
    logits = torch.tensor([[1.0, 2.0, 0.5, 2.0]], dtype=torch.bfloat16)
    before = logits.clone()
    rows = [row(temperature=0.7, top_k=2, top_p=0.9, min_p=0.1, repetition_penalty=1.3,
                presence_penalty=0.5, output=[1], banned=[3])]
    result = Sampler(gen(0))(logits, rows)
    assert torch.equal(logits, before)
    assert result.token_ids[0] in (0, 1)


def test_shape_mismatch_rejected():
    with pytest.raises(ValueError, match="len\\(rows\\)=2"):
        Sampler()(torch.zeros(3, 4), [row(), row()])


# --------------------------------------------------------------------------- processing order through the sampler

def test_sampler_applies_top_k_before_top_p():
    logits = log_probs(0.4, 0.3, 0.2, 0.1).repeat(2000, 1)
    tokens = Sampler(gen(0))(logits, [row(top_k=2, top_p=0.5)] * 2000).token_ids
    assert set(tokens) == {0}


def test_sampler_applies_min_p_before_top_p():
    # As vLLM v1: min-p 0.3 drops the 0.1 token; top-p 0.75 then measures the renormalised
    # .44/.33/.22, and the mass above the third token (.78) already reaches it.
    logits = log_probs(0.4, 0.3, 0.2, 0.1).repeat(2000, 1)
    rows = [row(top_p=0.75, min_p=0.3)] * 1000 + [row(top_p=0.75, min_p=0.3, seed=i, generator=gen(i))
                                                   for i in range(1000)]
    tokens = Sampler(gen(0))(logits, rows).token_ids
    assert set(tokens[:1000]) == set(tokens[1000:]) == {0, 1}
    assert tokens.count(0) / len(tokens) == pytest.approx(4 / 7, abs=0.04)


def test_sampler_applies_temperature_before_top_p():
    # T=0.5 squares the ratios: probs become .53/.30/.13/.03, so top-p=0.5 keeps one token
    # (on the untempered probs it would keep two).
    logits = log_probs(0.4, 0.3, 0.2, 0.1).repeat(2000, 1)
    tokens = Sampler(gen(0))(logits, [row(temperature=0.5, top_p=0.5)] * 2000).token_ids
    assert set(tokens) == {0}


def test_sampler_applies_each_rows_own_masks():
    logits = log_probs(0.4, 0.3, 0.2, 0.1).repeat(4000, 1)
    # top-p 0.65: mass above the third token is 0.7; min-p 0.45: cutoff 0.18.
    kinds = [dict(top_k=1), dict(top_p=0.65), dict(min_p=0.45), dict()]
    rows = [row(**kinds[i % 4]) for i in range(4000)]
    tokens = Sampler(gen(0))(logits, rows).token_ids
    seen = [set(tokens[i::4]) for i in range(4)]
    assert seen == [{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}]


def test_sampler_applies_penalties_before_top_k():
    # The repetition penalty pushes token 0 below token 2, so top-k=2 keeps {1, 2}.
    logits = torch.tensor([[3.0, 2.8, 2.0, 0.0]]).repeat(2000, 1)
    rows = [row(prompt=[0], repetition_penalty=2.0, top_k=2)] * 2000
    assert set(Sampler(gen(0))(logits, rows).token_ids) == {1, 2}


# --------------------------------------------------------------------------- distribution

LOGITS_5 = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])


def frequencies(tokens: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab_size).double() / len(tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_unseeded_draws_follow_softmax(temperature):
    n = 20000
    tokens = Sampler(gen(7))(LOGITS_5.repeat(n, 1), [row(temperature=temperature)] * n).token_ids
    expected = (LOGITS_5.double() / temperature).softmax(-1)
    # 3.4 standard deviations at the worst-case p = 0.5.
    assert (frequencies(tokens, 5) - expected).abs().max().item() < 0.012


def test_seeded_draws_follow_softmax():
    n = 5000
    rows = [row(seed=i, generator=gen(i)) for i in range(n)]
    tokens = Sampler()(LOGITS_5.repeat(n, 1), rows).token_ids
    expected = LOGITS_5.double().softmax(-1)
    assert (frequencies(tokens, 5) - expected).abs().max().item() < 0.025


def test_top_k_two_draws_stay_in_top_two_with_renormalised_frequencies():
    n = 20000
    tokens = Sampler(gen(3))(LOGITS_5.repeat(n, 1), [row(top_k=2)] * n).token_ids
    freq = frequencies(tokens, 5)
    assert set(tokens) == {0, 3}
    assert freq[3].item() == pytest.approx(1 / (1 + math.exp(-1.0)), abs=0.012)


# --------------------------------------------------------------------------- seeds

VOCAB = 50
STEPS = 30


def seeded_sequence(seed: int, batch_size: int, position: int, batch_seed: int = 0) -> list[int]:
    """Tokens the seeded row picks over STEPS steps, surrounded by batch_size - 1 other rows."""
    own_logits = torch.randn(STEPS, VOCAB, generator=gen(123))
    noise = gen(batch_seed)
    sampler = Sampler(gen(1000 + batch_seed))
    own_gen = gen(seed)
    others = [
        dict(temperature=0.8, top_k=10),
        dict(temperature=0),
        dict(temperature=1.3, top_p=0.7, min_p=0.05, presence_penalty=0.4),
        dict(temperature=1.0, seed=99),
    ]
    other_gens = [gen(99 + batch_seed) if "seed" in o else None for o in others]
    out: list[int] = []
    other_out: list[list[int]] = [[] for _ in others]
    for step in range(STEPS):
        logits = torch.randn(batch_size, VOCAB, generator=noise) * 3
        logits[position] = own_logits[step]
        rows = []
        for i in range(batch_size):
            if i == position:
                rows.append(row(prompt=[1, 2, 3], output=out, generator=own_gen, seed=seed,
                                temperature=0.9, repetition_penalty=1.2))
            else:
                j = (i - (i > position)) % len(others)
                rows.append(row(prompt=[4], output=other_out[j], generator=other_gens[j],
                                **others[j]))
        tokens = sampler(logits, rows).token_ids
        out.append(tokens[position])
        for i, t in enumerate(tokens):
            if i != position:
                other_out[(i - (i > position)) % len(others)].append(t)
    return out


def test_seeded_row_reproducible_regardless_of_batch():
    alone = seeded_sequence(seed=42, batch_size=1, position=0)
    assert len(set(alone)) > 5   # genuinely random, not collapsed to argmax
    assert seeded_sequence(seed=42, batch_size=5, position=0) == alone
    assert seeded_sequence(seed=42, batch_size=5, position=3) == alone
    assert seeded_sequence(seed=42, batch_size=5, position=4, batch_seed=9) == alone


def test_different_seeds_differ():
    a = seeded_sequence(seed=1, batch_size=1, position=0)
    b = seeded_sequence(seed=2, batch_size=1, position=0)
    assert a != b


# --------------------------------------------------------------------------- logprobs

def test_logprobs_come_from_raw_logits_with_rank_and_sorted_top():
    raw = torch.tensor([[1.0, 3.0, 2.0, 0.5, 2.5]] * 3)
    rows = [
        # Bans 1 and 4 and penalises 0, so greedy picks 2: third best by raw logit.
        row(prompt=[0], banned=[1, 4], temperature=0, repetition_penalty=3.0, logprobs=3),
        row(temperature=0.5, presence_penalty=1.0, output=[1], logprobs=0),
        row(temperature=0),
    ]
    result = Sampler(gen(0))(raw, rows)
    expected = raw[0].log_softmax(-1)
    first = result.logprobs[0]
    assert result.token_ids[0] == 2
    assert (first.token_id, first.rank) == (2, 3)
    assert first.logprob == pytest.approx(expected[2].item(), abs=1e-6)
    assert [t for t, _ in first.top] == [1, 4, 2]
    assert [lp for _, lp in first.top] == pytest.approx(
        [expected[1].item(), expected[4].item(), expected[2].item()], abs=1e-6)

    second = result.logprobs[1]
    tok = result.token_ids[1]
    assert second.token_id == tok and second.top == []
    assert second.logprob == pytest.approx(expected[tok].item(), abs=1e-6)
    assert second.rank == 1 + int((raw[1] > raw[1, tok]).sum())
    assert result.logprobs[2] is None


def test_logprob_rank_shared_by_tied_logits():
    raw = torch.tensor([[2.0, 2.0, 1.0]])
    result = Sampler()(raw, [row(temperature=0, banned=[0], logprobs=1)])
    lp = result.logprobs[0]
    assert (lp.token_id, lp.rank) == (1, 1)
    assert lp.top[0][1] == pytest.approx(math.log(math.e**2 / (2 * math.e**2 + math.e)), abs=1e-6)


def test_logprobs_from_half_precision_logits():
    raw = torch.tensor([[0.25, 1.5, -0.75]], dtype=torch.float16)
    result = Sampler()(raw, [row(temperature=0, logprobs=2)])
    expected = raw.float().log_softmax(-1)[0]
    assert result.logprobs[0].top == [(1, pytest.approx(expected[1].item(), abs=1e-6)),
                                      (0, pytest.approx(expected[0].item(), abs=1e-6))]


@pytest.mark.parametrize("top_n", [0, 1, 4])
def test_scores_over_many_cache_sized_blocks_equal_one_pass_over_all_rows(top_n):
    """score_tokens goes SCORE_BLOCK_ELEMENTS at a time on a CPU: 300 rows of a 5,000-token
    vocabulary are 6 blocks; every row's logprob, rank and best tokens are those of the whole."""
    from engine.sampler import SCORE_BLOCK_ELEMENTS, score_tokens
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 5000, generator=gen) * 4
    tokens = torch.randint(0, 5000, (300,), generator=gen)
    assert SCORE_BLOCK_ELEMENTS // 5000 < 300 // 5
    scores = score_tokens(logits, tokens, top_n)
    logprobs = logits.log_softmax(dim=-1)
    assert scores.token_ids == tokens.tolist()
    assert scores.logprobs == pytest.approx(logprobs.gather(1, tokens[:, None]).squeeze(1).tolist(), abs=1e-6)
    assert scores.ranks == ((logits > logits.gather(1, tokens[:, None])).sum(-1) + 1).tolist()
    if top_n:
        best = logprobs.topk(top_n, dim=-1)
        assert scores.top_ids == best.indices.tolist()
        assert [v for row in scores.top_logprobs for v in row] == \
            pytest.approx(best.values.flatten().tolist(), abs=1e-6)
    else:
        assert scores.top_ids == [[]] * 300
