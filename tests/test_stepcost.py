"""The step-time model (stepcost.py): exact on synthetic timings, follows a host that turns
slower, shrugs off a stall, keeps what it knows through a run of one kind of step, and is the
model diagnose fits too (a planted ~2,000-token prefill cost is explained, not a stall)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tailserve.analyze.data import Steps
from tailserve.analyze.stepmodel import fit_step_model
from tailserve.stepcost import (
    StepShape,
    StepTimeModel,
    features,
    prefill_attention_pairs,
    solve_nonneg,
    stall_excess,
)

# A made-up engine: 8 ms base, 0.4 ms per prefill token, 0.5 ms per decode, 0.2 ms per 1k
# context tokens read, 40 ms per 1M attention pairs (a 2,000-token prompt from its start:
# 800 ms linear + 80 ms quadratic).
TRUE = (0.008, 0.4, 0.005, 0.002, 0.040)


def cost(shape: StepShape, factor: float = 1.0) -> float:
    return factor * sum(c * x for c, x in zip(TRUE, shape.row(), strict=True))


def random_shape(rng: random.Random) -> StepShape:
    """What a serving engine's steps look like: mostly decodes, some with a prefill chunk."""
    d = rng.randint(0, 16)
    shape = StepShape()
    for _ in range(d):
        shape = shape.plus_decode(rng.randint(16, 1500))
    if rng.random() < 0.4 or d == 0:
        start = rng.choice([0, 0, 256, 1024])
        shape = shape.plus_chunk(start, rng.choice([32, 64, 128, 256, 512]))
    return shape


def test_pairs_and_features() -> None:
    assert prefill_attention_pairs(0, 4) == 1 + 2 + 3 + 4
    assert prefill_attention_pairs(10, 2) == 11 + 12
    s = StepShape().plus_decode(100).plus_decode(50).plus_chunk(0, 4).plus_chunk(10, 2)
    assert s == StepShape(6, 2, 150, 10 + 23)
    assert s.row() == features(6, 2, 150, 33) == pytest.approx([1.0, 6e-3, 0.2, 150e-4, 33e-6])


def test_solve_nonneg_drops_a_negative_term() -> None:
    # y = 2 + 3x exactly, plus a column the data would give a negative weight.
    xs = [(1.0, float(x), float(-x + (x % 2))) for x in range(10)]
    ys = [2 + 3 * x[1] for x in xs]
    a = [[sum(r[i] * r[j] for r in xs) for j in range(3)] for i in range(3)]
    b = [sum(r[i] * y for r, y in zip(xs, ys, strict=True)) for i in range(3)]
    theta = solve_nonneg(a, b)
    assert min(theta) >= 0
    assert theta[0] == pytest.approx(2, abs=1e-6) and theta[1] == pytest.approx(3, abs=1e-6)


def test_online_fit_recovers_synthetic_costs_and_long_prefills() -> None:
    rng = random.Random(1)
    m = StepTimeModel()
    for _ in range(300):
        sh = random_shape(rng)
        m.observe(sh, cost(sh))
    for got, want in zip(m.effective_coef, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.02, abs=1e-5)
    # The long prefill a straight line under-predicts: 2,000 tokens with 16 decodes.
    long = StepShape(0, 16, 16 * 800, 0).plus_chunk(0, 2000)
    assert m.predict(long) == pytest.approx(cost(long), rel=0.01)


def test_follows_a_host_that_turns_twice_as_slow() -> None:
    rng = random.Random(2)
    m = StepTimeModel()
    for _ in range(200):
        sh = random_shape(rng)
        m.observe(sh, cost(sh))
    probe = [random_shape(random.Random(100 + i)) for i in range(20)]

    def worst_error(factor: float) -> float:
        return max(abs(m.predict(s) / cost(s, factor) - 1.0) for s in probe)

    assert worst_error(1.0) < 0.02
    # Throttled: every step now takes twice as long (a noisy neighbour, a halved clock).
    errors = []
    for _ in range(60):
        sh = random_shape(rng)
        m.observe(sh, cost(sh, 2.0))
        errors.append(worst_error(2.0))
    assert errors[0] > 0.4  # the first slow steps are a surprise...
    # ...and within 30 steps the model follows (SCALE_RATE first, then the fit itself).
    assert errors[-1] < 0.10, errors[::10]


def test_a_single_stall_barely_moves_the_model() -> None:
    rng = random.Random(3)
    m = StepTimeModel()
    for _ in range(200):
        sh = random_shape(rng)
        m.observe(sh, cost(sh))
    sh = StepShape(0, 8, 8 * 500, 0)
    before = m.predict(sh)
    m.observe(sh, cost(sh) + 0.5)  # a 500 ms pause on a ~13 ms step
    assert m.predict(sh) < 1.2 * before
    assert stall_excess(before, cost(sh) + 0.5, m.sigma_s) > 0.45
    assert stall_excess(before, 1.5 * before, m.sigma_s) == 0.0  # 1.5x is no stall


def test_decode_only_stretch_keeps_the_prefill_cost() -> None:
    rng = random.Random(4)
    m = StepTimeModel()
    for _ in range(200):
        sh = random_shape(rng)
        m.observe(sh, cost(sh))
    prefill = StepShape().plus_chunk(0, 512)
    for _ in range(400):
        d = rng.randint(1, 16)
        sh = StepShape(0, d, d * rng.randint(100, 900), 0)
        m.observe(sh, cost(sh))
    assert m.predict(prefill) == pytest.approx(cost(prefill), rel=0.05)


def test_seed_then_max_chunk_is_the_largest_aligned_chunk_within_target() -> None:
    m = StepTimeModel()
    shapes = [random_shape(random.Random(10 + i)) for i in range(12)]
    m.seed(shapes, [cost(s) for s in shapes])
    base = StepShape(0, 8, 8 * 500, 0)
    target = 0.060
    n = m.max_chunk(base, 0, 1000, target, 32)
    assert n % 32 == 0 and n > 0
    assert m.predict(base.plus_chunk(0, n)) <= target < m.predict(base.plus_chunk(0, n + 32))
    assert m.max_chunk(base, 0, 20, target, 32) == 20  # the whole rest fits
    assert m.max_chunk(base, 0, 1000, 0.001, 32) == 0  # the decodes alone exceed it


def test_diagnose_fits_the_same_model_and_explains_long_prefills() -> None:
    """Records as the engine writes them: a 2,000-token prefill among short ones takes what
    its attention costs, and the fit says so instead of calling it an engine stall."""
    rng = random.Random(5)
    recs = []
    t = 0.0
    for k in range(400):
        big = StepShape(0, 8, 8 * 300, 0).plus_chunk(0, 2000)
        sh = big if k % 40 == 20 else random_shape(rng)
        step = cost(sh) * (1 + 0.02 * rng.uniform(-1, 1))
        if k == 333:
            step += 0.3  # one real stall
        t += step
        recs.append({"t": t, "step_s": step, "num_prefill_tokens": sh.prefill_tokens,
                     "num_decode_seqs": sh.decode_seqs,
                     "num_decode_context_tokens": sh.decode_context_tokens,
                     "prefill_attention_pairs": sh.prefill_attention_pairs})
    steps = Steps.from_records(recs)
    fit = fit_step_model(steps)
    long = steps.prefill >= 2000
    assert np.allclose(fit.predicted[long], steps.step_s[long], rtol=0.05)
    assert list(np.nonzero(fit.stall)[0]) == [333]
    assert fit.describe()["ms_per_1k_prefill_tokens"] == pytest.approx(
        cost(StepShape().plus_chunk(0, 1000)) * 1e3 - TRUE[0] * 1e3, rel=0.05)
