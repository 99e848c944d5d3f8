"""Sampler: exact expectations for greedy, truncation, seeds, penalties, min_tokens, logprobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailserve.model.sampler import (
    Sampler,
    SamplingRow,
    apply_min_tokens,
    apply_penalties,
    argmax_rows,
)
from tailserve.model.top_k_top_p import TRUNCATION_CANDIDATES
from tailserve.sampling_params import SamplingParams

# chi-square quantiles at p = 0.001; every statistical test below uses a fixed seed, so it is
# deterministic, and a wrong distribution lands far beyond these bounds.
CHI2_999_DF1 = 10.83
CHI2_999_DF7 = 24.32


def make_row(
    params: SamplingParams | None = None,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    eos: Sequence[int] = (),
    seed: int | None = None,
) -> SamplingRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(
        params=params or SamplingParams(),
        prompt_token_ids=list(prompt),
        output_token_ids=list(output),
        eos_token_ids=list(eos),
        generator=generator,
    )


def seeded_randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def chi_square(token_ids: list[int], probs: torch.Tensor) -> float:
    observed = torch.bincount(torch.tensor(token_ids), minlength=probs.numel()).double()
    expected = probs.double() * len(token_ids)
    keep = expected > 0
    # A token with zero expected probability must never appear at all.
    assert observed[~keep].sum().item() == 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --- greedy ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(dtype: torch.dtype) -> None:
    logits = seeded_randn(7, 300).to(dtype)
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(7)]
    out = Sampler(300)(logits, rows)
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 7


NAN, INF = math.nan, math.inf
# Rows where an argmax can go wrong: ties (first index wins), NaN (ranked above everything,
# first NaN wins), infinities, all -inf, signed zeros (equal: first wins).
TRICKY_ROWS = [
    [1.0, 3.0, 3.0, 2.0], [NAN, 5.0, NAN, 1.0], [1.0, NAN, 9.0, NAN], [-INF] * 4,
    [INF, 1.0, INF, 0.0], [-0.0, 0.0, -0.0, 0.0], [0.0, -0.0, 0.0, 0.0], [-INF, NAN, INF, 2.0],
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64, torch.bfloat16])
def test_argmax_rows_equals_torch_argmax_on_ties_nan_and_infinities(dtype: torch.dtype) -> None:
    # The CPU argmax runs in numpy (bfloat16 stays on torch): the same index in every case.
    tricky = torch.tensor(TRICKY_ROWS, dtype=dtype)
    assert argmax_rows(tricky).tolist() == [1, 0, 1, 0, 0, 0, 0, 1]
    assert argmax_rows(tricky).tolist() == tricky.argmax(dim=-1).tolist()
    # Many exact ties (values rounded to 0.1), read through a column slice as the sampler does.
    wide = seeded_randn(16, 1000 + 24, seed=3).round(decimals=1).to(dtype)[:, :1000]
    assert torch.equal(argmax_rows(wide), wide.argmax(dim=-1))
    assert argmax_rows(wide).dtype == torch.int64


def test_greedy_on_ties_and_nan_matches_torch_argmax() -> None:
    logits = torch.tensor(TRICKY_ROWS)
    out = Sampler(4)(logits, [make_row(SamplingParams(temperature=0.0)) for _ in TRICKY_ROWS])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_mixed_with_random_rows() -> None:
    vocab = 1000
    logits = seeded_randn(8, vocab, seed=1, scale=0.1)  # nearly flat: random rows spread out
    greedy = [i % 2 == 0 for i in range(8)]
    rows = [make_row(SamplingParams(temperature=0.0 if g else 1.0)) for g in greedy]
    sampler = Sampler(vocab, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(dim=-1).tolist()
    random_hits = 0
    for _ in range(5):
        out = sampler(logits, rows)
        for i, token in enumerate(out.token_ids):
            if greedy[i]:
                assert token == argmax[i]
            else:
                random_hits += token == argmax[i]
    assert random_hits < 5  # 20 draws from ~uniform over 1000: the random rows really sample


def test_logits_beyond_vocab_size_are_never_sampled() -> None:
    # An lm_head padded to a multiple of 64 yields extra columns; they are not tokens.
    logits = torch.zeros(4, 64)
    logits[:, 50:] = 100.0
    rows = [make_row(SamplingParams(temperature=t)) for t in (0.0, 1.0, 0.0, 1.0)]
    out = Sampler(50, generator=torch.Generator().manual_seed(0))(logits, rows)
    assert all(0 <= t < 50 for t in out.token_ids)


def test_shape_mismatch_raises_value_error() -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        Sampler(100)(torch.zeros(2, 99), [make_row(), make_row()])
    with pytest.raises(ValueError, match="num_rows=1"):
        Sampler(100)(torch.zeros(2, 100), [make_row()])


def test_input_logits_are_not_modified() -> None:
    logits = seeded_randn(4, 40)
    before = logits.clone()
    rows = [
        make_row(SamplingParams(temperature=0.0, repetition_penalty=1.5), prompt=[1, 2]),
        make_row(SamplingParams(top_k=3, top_p=0.5, min_p=0.2, logprobs=2)),
        make_row(SamplingParams(min_tokens=2, stop_token_ids=[5]), eos=[0]),
        make_row(SamplingParams(temperature=0.5, frequency_penalty=1.0), output=[3, 3]),
    ]
    Sampler(40)(logits, rows)
    assert torch.equal(logits, before)


# --- truncation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(min_p=1.0),
        SamplingParams(temperature=0.7, top_k=1, top_p=0.9),
    ],
    ids=["top_k=1", "top_p=1e-6", "min_p=1", "top_k=1+top_p"],
)
def test_truncation_to_one_token_equals_greedy(params: SamplingParams) -> None:
    logits = seeded_randn(64, 500, seed=2)
    out = Sampler(500, generator=torch.Generator().manual_seed(0))(
        logits, [make_row(params) for _ in range(64)]
    )
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_never_samples_outside_top_k() -> None:
    vocab, k, draws = 50, 5, 4000
    logits = seeded_randn(vocab, seed=3, scale=0.3).expand(draws, vocab)  # nearly flat
    rows = [make_row(SamplingParams(top_k=k)) for _ in range(draws)]
    out = Sampler(vocab, generator=torch.Generator().manual_seed(0))(logits, rows)
    top_k = set(logits[0].topk(k).indices.tolist())
    assert set(out.token_ids) == top_k  # nothing outside, and every one of the k reachable


def test_temperature_one_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    draws = 20000
    rows = [make_row() for _ in range(draws)]
    out = Sampler(8, generator=torch.Generator().manual_seed(0))(logits.expand(draws, 8), rows)
    assert chi_square(out.token_ids, logits.softmax(-1)) < CHI2_999_DF7


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 0.3, 1.5])
    draws = 20000
    rows = [make_row(SamplingParams(temperature=0.5)) for _ in range(draws)]
    out = Sampler(8, generator=torch.Generator().manual_seed(1))(logits.expand(draws, 8), rows)
    assert chi_square(out.token_ids, (logits / 0.5).softmax(-1)) < CHI2_999_DF7
    # ...and clearly not the temperature-1 distribution.
    assert chi_square(out.token_ids, logits.softmax(-1)) > 10 * CHI2_999_DF7


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=2), SamplingParams(top_p=0.7), SamplingParams(min_p=0.4)],
    ids=["top_k=2", "top_p=0.7", "min_p=0.4"],
)
def test_truncation_keeps_expected_set_and_renormalises(params: SamplingParams) -> None:
    # probs 0.5, 0.3, 0.15, 0.05: top-2, the smallest set with mass >= 0.7, and every token
    # with p >= 0.4 * 0.5 are all {0, 1}, sampled as 0.625 / 0.375.
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    draws = 20000
    rows = [make_row(params) for _ in range(draws)]
    out = Sampler(4, generator=torch.Generator().manual_seed(2))(logits.expand(draws, 4), rows)
    assert chi_square(out.token_ids, torch.tensor([0.625, 0.375, 0.0, 0.0])) < CHI2_999_DF1


def test_top_p_applies_to_the_top_k_renormalised_distribution() -> None:
    # probs 0.4, 0.3, 0.2, 0.1; top-3 renormalises to 4/9, 3/9, 2/9, whose mass before token 2
    # is 7/9 >= 0.72, so top-p keeps {0, 1} (on the raw probs it would keep {0, 1, 2}).
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    draws = 20000
    rows = [make_row(SamplingParams(top_k=3, top_p=0.72)) for _ in range(draws)]
    out = Sampler(4, generator=torch.Generator().manual_seed(3))(logits.expand(draws, 4), rows)
    assert chi_square(out.token_ids, torch.tensor([4 / 7, 3 / 7, 0.0, 0.0])) < CHI2_999_DF1


@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.995])
def test_top_p_nucleus_wider_than_the_candidates(top_p: float) -> None:
    # Nearly flat logits over 5000 tokens: nuclei of ~330, ~4200 and ~4960 tokens run past the
    # first TRUNCATION_CANDIDATES (the last two also past the second, 4096-wide, try), so the
    # wider retries must find the same cut as a reference full sort.
    vocab, draws = 5000, 600
    logits = torch.linspace(1.0, 0.0, vocab)  # token 0 highest, strictly decreasing, no ties
    probs = logits.softmax(-1)
    nucleus = int(((probs.cumsum(-1) - probs) < top_p).sum())
    assert nucleus > TRUNCATION_CANDIDATES
    rows = [make_row(SamplingParams(top_p=top_p)) for _ in range(draws)]
    out = Sampler(vocab, generator=torch.Generator().manual_seed(4))(
        logits.expand(draws, vocab), rows
    )
    assert max(out.token_ids) < nucleus
    assert max(out.token_ids) >= nucleus * 0.97  # the whole nucleus is reachable


def test_rows_without_truncation_are_untouched_by_truncating_batch_mates() -> None:
    vocab, draws = 1000, 1000
    logits = torch.linspace(0.1, 0.0, vocab).expand(draws, vocab)  # nearly uniform
    rows = [
        make_row(SamplingParams(top_p=0.5) if i % 2 else SamplingParams()) for i in range(draws)
    ]
    out = Sampler(vocab, generator=torch.Generator().manual_seed(5))(logits, rows)
    assert max(out.token_ids[1::2]) < vocab // 2 + 25  # the top-p rows stay in their nucleus
    assert max(out.token_ids[0::2]) >= vocab - 25  # the others reach the whole vocabulary


# --- seeds ----------------------------------------------------------------------------------


def _run_seeded(seed: int, position: int | None, steps: int = 12) -> list[int]:
    """Tokens of one seeded request; alone when ``position`` is None, else in a batch of 8."""
    vocab = 1000
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
    row = make_row(params, prompt=[1, 2, 3], seed=seed)
    sampler = Sampler(vocab, generator=torch.Generator().manual_seed(1000 + (position or 0)))
    output: list[int] = []
    for step in range(steps):
        row.output_token_ids = list(output)
        own_logits = seeded_randn(vocab, seed=step)
        if position is None:
            token = sampler(own_logits.unsqueeze(0), [row]).token_ids[0]
        else:
            mates = [
                make_row(SamplingParams()),
                make_row(SamplingParams(temperature=0.0)),
                make_row(SamplingParams(seed=99), seed=99),
                make_row(SamplingParams(top_k=5, repetition_penalty=1.3), prompt=[4, 5]),
                make_row(SamplingParams(min_p=0.1, logprobs=3)),
                make_row(SamplingParams(temperature=1.5, frequency_penalty=0.5), output=[7]),
                make_row(SamplingParams(min_tokens=4, stop_token_ids=[1]), eos=[0]),
            ]
            slot = (position + step) % 8  # a different batch position every step
            rows = [*mates[:slot], row, *mates[slot:]]
            logits = seeded_randn(8, vocab, seed=500 + step)
            logits[slot] = own_logits
            token = sampler(logits, rows).token_ids[slot]
        output.append(token)
    return output


def test_seeded_row_is_independent_of_batch_mates_and_position() -> None:
    alone = _run_seeded(1234, None)
    assert _run_seeded(1234, 0) == alone
    assert _run_seeded(1234, 5) == alone


def test_different_seeds_give_different_tokens() -> None:
    assert _run_seeded(1234, None) != _run_seeded(1235, None)


# --- penalties ------------------------------------------------------------------------------


def test_apply_penalties_exact_values() -> None:
    base = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0, -2.0])
    logits = base.expand(4, 6).clone()
    rows = [
        make_row(
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            prompt=[0, 1],
            output=[1, 2, 2],
        ),
        make_row(SamplingParams(), prompt=[0, 1, 2], output=[2]),  # no penalty: untouched
        make_row(SamplingParams(frequency_penalty=-0.5), prompt=[0], output=[3, 3, 3]),
        make_row(SamplingParams(repetition_penalty=0.5), prompt=[4, 5]),
    ]
    expected = torch.tensor(
        [
            # 0: seen in prompt, 2 / 2.  1: -1 * 2 - 0.5 - 0.25 * 1.  2: 0.5 / 2 - 0.5 - 0.25 * 2
            [1.0, -2.75, -0.75, 0.0, 3.0, -2.0],
            [2.0, -1.0, 0.5, 0.0, 3.0, -2.0],
            # frequency only, over output tokens only: 0 - (-0.5 * 3); prompt token 0 untouched
            [2.0, -1.0, 0.5, 1.5, 3.0, -2.0],
            # penalty < 1 rewards repeats: 3 / 0.5 and -2 * 0.5
            [2.0, -1.0, 0.5, 0.0, 6.0, -1.0],
        ]
    )
    result = apply_penalties(logits, rows, 6)
    torch.testing.assert_close(result, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits, base.expand(4, 6))  # input untouched


def test_apply_penalties_ignores_ids_outside_the_vocabulary() -> None:
    # Left in, id 6 of row 0 would address row 1's token 0 in the flattened logits.
    logits = torch.ones(2, 6)
    rows = [make_row(SamplingParams(repetition_penalty=2.0), prompt=[6, 1]), make_row()]
    expected = torch.ones(2, 6)
    expected[0, 1] = 0.5
    assert torch.equal(apply_penalties(logits, rows, 6), expected)


def test_apply_penalties_without_penalties_is_identity() -> None:
    logits = seeded_randn(3, 10)
    result = apply_penalties(logits, [make_row(output=[1, 1]) for _ in range(3)], 10)
    assert torch.equal(result, logits)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    rows = [make_row(SamplingParams(temperature=0.0, presence_penalty=0.5), output=[1])]
    assert Sampler(4)(logits, rows).token_ids == [2]


# --- min_tokens -----------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    # EOS 9 is the best token, stop id 8 the second, 3 the third.
    logits = torch.zeros(1, 10)
    logits[0, 9], logits[0, 8], logits[0, 3] = 10.0, 9.0, 8.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8, 50])
    sampler = Sampler(10)
    for produced, expected in [(0, 3), (2, 3), (3, 9), (4, 9)]:
        row = make_row(params, output=[1] * produced, eos=[9])
        assert sampler(logits, [row]).token_ids == [expected], produced


def test_min_tokens_with_ignore_eos_bans_only_stop_token_ids() -> None:
    # With ignore_eos, EOS is not a stop, so min_tokens has no reason to ban it.
    logits = torch.zeros(1, 10)
    logits[0, 9], logits[0, 8] = 10.0, 9.0
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[8], ignore_eos=True)
    row = make_row(params, eos=[9])
    masked = apply_min_tokens(logits, [row])
    assert masked[0, 8].item() == -math.inf
    assert masked[0, 9].item() == 10.0
    assert Sampler(10)(logits, [row]).token_ids == [9]


def test_min_tokens_random_rows_never_sample_stops() -> None:
    draws = 2000
    logits = torch.zeros(draws, 10)  # uniform: stops would be 20% of draws
    params = SamplingParams(min_tokens=1, stop_token_ids=[4])
    rows = [make_row(params, eos=[7]) for _ in range(draws)]
    out = Sampler(10, generator=torch.Generator().manual_seed(0))(logits, rows)
    assert set(out.token_ids) == set(range(10)) - {4, 7}


# --- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_top_n_plus_sampled() -> None:
    vocab = 30
    logits = seeded_randn(5, vocab, seed=4)
    raw = torch.log_softmax(logits, dim=-1)
    order = raw.argsort(dim=-1, descending=True).tolist()
    banned = order[3][0]  # row 3's best token is its EOS, banned by min_tokens
    rows = [
        make_row(SamplingParams(temperature=0.0, logprobs=3)),
        # logprobs=0: only the sampled token, still from the raw (unpenalised, unscaled) logits
        make_row(SamplingParams(temperature=0.5, repetition_penalty=1.7, logprobs=0), [1, 2]),
        make_row(SamplingParams(temperature=0.0)),
        make_row(SamplingParams(temperature=0.0, min_tokens=1, logprobs=1), eos=[banned]),
        make_row(SamplingParams(top_k=4, logprobs=20)),
    ]
    out = Sampler(vocab, generator=torch.Generator().manual_seed(0))(logits, rows)
    tokens = out.token_ids
    lp = out.logprobs

    assert lp[2] is None
    assert lp[0] is not None and list(lp[0]) == order[0][:3]  # top-3, descending
    assert tokens[0] == order[0][0]
    assert lp[1] is not None and list(lp[1]) == [tokens[1]]
    # The sampled token is not in row 3's top-1 (its EOS), so it is added as a second entry.
    assert tokens[3] == order[3][1]
    assert lp[3] is not None and list(lp[3]) == [banned, tokens[3]]
    assert lp[4] is not None and list(lp[4]) == order[4][:20]
    assert tokens[4] in order[4][:4]
    for i in (0, 1, 3, 4):
        entry = lp[i]
        assert entry is not None and tokens[i] in entry
        for token, value in entry.items():
            assert value == pytest.approx(raw[i, token].item(), abs=1e-6)


def test_logprobs_of_half_precision_logits_are_computed_in_float32() -> None:
    logits = seeded_randn(2, 100, seed=5).to(torch.bfloat16)
    rows = [make_row(SamplingParams(temperature=0.0, logprobs=5)) for _ in range(2)]
    out = Sampler(100)(logits, rows)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        assert entry is not None
        expected = raw[i].topk(5)
        assert list(entry) == expected.indices.tolist()
        assert list(entry.values()) == expected.values.tolist()  # bit-exact float32


# --- property -------------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> tuple[int, list[SamplingRow], int]:
    # Large vocabularies push top-p nuclei past the first truncation candidates.
    vocab = draw(st.integers(min_value=3, max_value=40) | st.sampled_from([300, 1000]))
    token = st.integers(min_value=0, max_value=vocab - 1)
    rows = []
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        seed = draw(st.none() | st.integers(min_value=0, max_value=2**31))
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.3, 1.0, 1.7])),
            top_k=draw(st.integers(min_value=0, max_value=vocab + 2)),
            top_p=draw(st.floats(min_value=0.01, max_value=1.0)),
            min_p=draw(st.floats(min_value=0.0, max_value=1.0)),
            repetition_penalty=draw(st.floats(min_value=0.5, max_value=2.0)),
            presence_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
            frequency_penalty=draw(st.floats(min_value=-2.0, max_value=2.0)),
            min_tokens=draw(st.integers(min_value=0, max_value=3)),
            # at most one stop id below vocab - 1 plus EOS vocab - 1: some token always survives
            stop_token_ids=draw(st.lists(st.integers(0, vocab - 2), max_size=1)),
            logprobs=draw(st.none() | st.integers(min_value=0, max_value=5)),
            seed=seed,
        )
        rows.append(
            make_row(
                params,
                prompt=draw(st.lists(token, max_size=8)),
                output=draw(st.lists(token, max_size=8)),
                eos=[vocab - 1],
                seed=seed,
            )
        )
    return vocab, rows, draw(st.integers(min_value=0, max_value=2**16))


@settings(max_examples=60, deadline=None)
@given(batches())
def test_sampled_tokens_are_valid_and_respect_truncation(
    batch: tuple[int, list[SamplingRow], int],
) -> None:
    vocab, rows, logits_seed = batch
    logits = seeded_randn(len(rows), vocab, seed=logits_seed, scale=2.0)
    out = Sampler(vocab, generator=torch.Generator().manual_seed(logits_seed))(logits, rows)
    processed = apply_penalties(apply_min_tokens(logits, rows), rows, vocab)
    assert len(out.token_ids) == len(rows) == len(out.logprobs)
    for i, (row, token) in enumerate(zip(rows, out.token_ids, strict=True)):
        params = row.params
        assert 0 <= token < vocab
        value = processed[i, token]
        assert math.isfinite(value.item())  # never a min_tokens-banned token
        if params.greedy:
            assert value.item() == processed[i].max().item()
        else:
            scaled = processed[i] / params.temperature
            if 0 < params.top_k < vocab:
                assert (processed[i] > value).sum().item() < params.top_k
                scaled = scaled.masked_fill(
                    scaled < scaled.topk(params.top_k).values[-1], -math.inf
                )
            # top-p (after top-k): the mass strictly above the token is below top_p
            probs = scaled.softmax(-1)
            assert probs[scaled > scaled[token]].sum().item() < params.top_p + 1e-4
            # min_p: p_token / p_max = exp((l - l_max) / T) >= min_p
            ratio = math.exp((value - processed[i].max()).item() / params.temperature)
            assert ratio >= params.min_p * (1 - 1e-4)
        entry = out.logprobs[i]
        assert (entry is None) == (params.logprobs is None)
        if entry is not None:
            assert token in entry
            assert len(entry) <= params.logprobs + 1  # type: ignore[operator]
