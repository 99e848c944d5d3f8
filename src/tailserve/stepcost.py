"""The step-time model: what one engine step should cost given its batch.

    step_s ≈ base + c₁·prefill_tokens + c₂·decode_seqs + c₃·decode_context_tokens
                  + c₄·prefill_attention_pairs

``decode_context_tokens`` is the KV every decode reads (the sum of their context lengths);
``prefill_attention_pairs`` the (query, key) pairs causal attention computes for the prefill
chunks, ``Σ n·(start + (n+1)/2)`` over chunks of ``n`` tokens starting at ``start``: the term
that grows with the square of a long prompt and that a straight line in token counts misses
(a 2,000-token prefill then takes 2-3× what the line predicts).

One model, two users: the scheduler sizes each step's prefill from ``StepTimeModel`` (learned
online from the engine's own steps, seeded by a start-up calibration) and ``tailserve
diagnose`` fits the same features to a run's step records with the same solver, so "the batch
explains it" and "the engine stalled" (``stall_excess``) are told apart the same way in both.

Pure Python (no numpy, no torch): the scheduler imports it, and a 5×5 solve per step costs
microseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FEATURES = ("base", "prefill_tokens", "decode_seqs", "decode_context_tokens",
            "prefill_attention_pairs")
# Units that keep every column near 1 for a typical CPU step, so one ridge weight suits all:
# 1k prefill tokens, 10 decodes, 10k context tokens read, 1M attention pairs.
SCALES = (1.0, 1e-3, 0.1, 1e-4, 1e-6)
N = len(FEATURES)

# A step is a stall when what it took beyond the prediction is at least STALL_SIGMAS robust
# residual deviations, more than STALL_REL × the prediction (over twice what its batch
# explains) and at least STALL_MIN_S: noise on a 1 ms step is not a stall.
STALL_SIGMAS = 5.0
STALL_REL = 1.0
STALL_MIN_S = 1e-3

# Online fit: observations weigh FORGET^age (an effective window of ~1/(1-FORGET) = 32 steps,
# so a host that turns slower is followed within a few tens of steps); RIDGE pseudo-weight
# holds each coefficient at its last value in directions the recent steps do not excite (a run
# of decode-only steps must not forget what a prefill token costs). An observation is clipped
# to CLIP_REL × the prediction (+ CLIP_MIN_S) before it updates the fit: a single 10× stall
# moves the model by no more than a 2× step would, while a host that stays slow still pulls
# the prediction up geometrically.
# The fit alone follows a change at its forgetting rate; SCALE_RATE is the faster one of a
# multiplier on its predictions (an average of measured / fitted over recent steps, within
# SCALE_BOUNDS), so a host that turns slower is followed within ~15 steps in every direction
# of the fit, also the ones the recent steps do not excite. The fit learns times divided by
# the multiplier: the relative costs of the batch's parts, the multiplier the host's speed.
FORGET = 0.97
RIDGE = 0.05
CLIP_REL = 2.0
CLIP_MIN_S = 2e-3
SCALE_RATE = 0.15
SCALE_BOUNDS = (0.25, 4.0)
SCALE_STEP_MAX = 1.5
# The normal equations take every step; the solve (a few 5x5 eliminations in pure Python,
# ~0.1 ms) runs every REFIT_EVERY steps, the multiplier every step.
REFIT_EVERY = 4


def prefill_attention_pairs(start: int, n: int) -> int:
    """Causal (query, key) pairs of a chunk of ``n`` tokens after ``start`` computed ones."""
    return n * start + n * (n + 1) // 2


def features(prefill_tokens: Any, decode_seqs: Any, decode_context_tokens: Any,
             attention_pairs: Any) -> list[Any]:
    """The scaled feature row: floats in, floats out (the arithmetic also broadcasts over
    numpy arrays, which is how diagnose builds its design matrix from the same code)."""
    raw = (prefill_tokens, decode_seqs, decode_context_tokens, attention_pairs)
    return [1.0] + [v * s for v, s in zip(raw, SCALES[1:], strict=True)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-15:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x


def solve_nonneg(a: Sequence[Sequence[float]], b: Sequence[float],
                 active: Sequence[int] | None = None) -> list[float]:
    """min ‖Xθ - y‖² with θ ≥ 0 from the normal equations ``a = XᵀX``, ``b = Xᵀy``: solve on
    the active terms, drop the most negative one, repeat. A negative cost per token would
    charge prefill with negative time; a negative base would make small steps look like
    stalls."""
    n = len(b)
    act = list(range(n)) if active is None else list(active)
    act = [j for j in act if a[j][j] > 0]
    while act:
        sol = _solve([[float(a[i][j]) for j in act] for i in act], [float(b[i]) for i in act])
        if sol is None:
            act.pop()  # a column that is a combination of the others: drop the last one
            continue
        neg = [(v, j) for v, j in zip(sol, act, strict=True) if v < 0]
        if not neg:
            theta = [0.0] * n
            for v, j in zip(sol, act, strict=True):
                theta[j] = v
            return theta
        act.remove(min(neg)[1])
    return [0.0] * n


def stall_excess(predicted_s: float, actual_s: float, sigma_s: float) -> float:
    """Seconds a step took beyond what its batch explains when that makes it a stall, else 0."""
    resid = actual_s - predicted_s
    if resid > STALL_SIGMAS * sigma_s and resid > STALL_REL * predicted_s and resid > STALL_MIN_S:
        return resid
    return 0.0


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on (the scheduler counts it while it builds the step)."""

    prefill_tokens: int = 0
    decode_seqs: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: int = 0

    def row(self) -> list[float]:
        return features(self.prefill_tokens, self.decode_seqs, self.decode_context_tokens,
                        self.prefill_attention_pairs)

    def plus_chunk(self, start: int, n: int) -> StepShape:
        """This shape with one more prefill chunk of ``n`` tokens after ``start``."""
        return StepShape(self.prefill_tokens + n, self.decode_seqs, self.decode_context_tokens,
                         self.prefill_attention_pairs + prefill_attention_pairs(start, n))

    def plus_decode(self, context: int) -> StepShape:
        return StepShape(self.prefill_tokens, self.decode_seqs + 1,
                         self.decode_context_tokens + context, self.prefill_attention_pairs)


class StepTimeModel:
    """The online step-time model: forgetting-weighted normal equations, ridge toward the last
    fit, non-negative coefficients, refit after every observed step; predictions times a
    fast-moving ``scale`` (measured / fitted, recently).

    ``coef`` are seconds per *scaled* feature (``SCALES``); ``describe()`` gives them in
    readable units. ``sigma_s`` is a running robust deviation of the residual (1.25 × the mean
    absolute residual, forgotten at the same rate).
    """

    def __init__(self, coef: Sequence[float] | None = None) -> None:
        self.coef = list(coef) if coef is not None else [0.0] * N
        self.scale = 1.0
        self._a = [[0.0] * N for _ in range(N)]
        self._b = [0.0] * N
        self.sigma_s = 0.0
        self._abs_resid = 0.0
        self._weight = 0.0
        self.num_observed = 0
        self.last_predicted_s: float | None = None
        self.last_actual_s: float | None = None

    def predict(self, shape: StepShape) -> float:
        return self.scale * sum(c * x for c, x in zip(self.coef, shape.row(), strict=True))

    def observe(self, shape: StepShape, step_s: float) -> float:
        """Learn from one measured step; returns the prediction made before learning."""
        x = shape.row()
        fitted = sum(c * v for c, v in zip(self.coef, x, strict=True))
        pred = self.scale * fitted
        # Nothing known yet: nothing to clip against.
        y = min(step_s, CLIP_REL * pred + CLIP_MIN_S) if self.num_observed else step_s
        # The fit learns the host's shape of costs at the speed the scale stands for now, so
        # the two never count one slowdown twice (their product is what is predicted).
        y_fit = y / self.scale
        if self.num_observed and fitted > 0:
            lo, hi = SCALE_BOUNDS
            # One step moves the multiplier by at most SCALE_RATE x 50%: a stall is no trend.
            ratio = min(max(y / fitted, lo), hi, SCALE_STEP_MAX * self.scale)
            self.scale = min(max((1 - SCALE_RATE) * self.scale + SCALE_RATE * ratio, lo), hi)
        resid = abs(step_s - pred) if self.num_observed else 0.0
        self._abs_resid = FORGET * self._abs_resid + min(resid, max(pred, CLIP_MIN_S))
        self._weight = FORGET * self._weight + 1.0
        self.sigma_s = 1.25 * self._abs_resid / self._weight
        for i in range(N):
            self._b[i] = FORGET * self._b[i] + x[i] * y_fit
            row = self._a[i]
            for j in range(N):
                row[j] = FORGET * row[j] + x[i] * x[j]
        self.num_observed += 1
        if self.num_observed % REFIT_EVERY == 0:
            self._refit()
        self.last_predicted_s, self.last_actual_s = pred, step_s
        return pred

    def _refit(self) -> None:
        # Ridge toward the current coefficients: (A + δI)θ = b + δθ_prev.
        a = [[self._a[i][j] + (RIDGE if i == j else 0.0) for j in range(N)] for i in range(N)]
        b = [self._b[i] + RIDGE * self.coef[i] for i in range(N)]
        self.coef = solve_nonneg(a, b)

    def seed(self, shapes: Sequence[StepShape], times: Sequence[float]) -> None:
        """Fit the calibration steps (equal weight, no clipping) as the starting point."""
        rows = [s.row() for s in shapes]
        a = [[sum(r[i] * r[j] for r in rows) + (1e-9 if i == j else 0.0) for j in range(N)]
             for i in range(N)]
        b = [sum(r[i] * t for r, t in zip(rows, times, strict=True)) for i in range(N)]
        self.coef = solve_nonneg(a, b)
        self.scale = 1.0
        self._a, self._b = a, b
        resid = [abs(t - self.predict(s)) for s, t in zip(shapes, times, strict=True)]
        self._weight = float(len(rows))
        self._abs_resid = sum(resid)
        self.sigma_s = 1.25 * self._abs_resid / max(self._weight, 1.0)
        self.num_observed = len(rows)

    # ------------------------------------------------------------------ budgeting
    def max_chunk(self, base: StepShape, start: int, remaining: int, target_s: float,
                  align: int) -> int:
        """The largest chunk of this request (``n ≤ remaining``, a multiple of ``align`` unless
        it is the whole remainder) that keeps the predicted step within ``target_s``; 0 when
        not even ``align`` tokens fit. Prediction grows with ``n``, so bisect."""
        if self.predict(base.plus_chunk(start, remaining)) <= target_s:
            return remaining
        lo, hi = 0, remaining // align  # in units of align; hi·align < remaining or == it
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.predict(base.plus_chunk(start, mid * align)) <= target_s:
                lo = mid
            else:
                hi = mid - 1
        return lo * align

    def prefill_time(self, tokens: int, start: int, decode: StepShape, chunk: int) -> float:
        """Predicted seconds to prefill ``tokens`` (after ``start`` computed) in chunks of
        ``chunk`` tokens while ``decode`` runs alongside every step."""
        chunk = max(chunk, 1)
        t = 0.0
        done = 0
        while done < tokens:
            n = min(chunk, tokens - done)
            t += self.predict(decode.plus_chunk(start + done, n))
            done += n
        return t

    @property
    def effective_coef(self) -> list[float]:
        """Seconds per scaled feature as predicted now (the fit times the host's scale)."""
        return [self.scale * c for c in self.coef]

    def describe(self) -> dict[str, float]:
        """Effective coefficients in readable units (ms per unit of each raw feature × its
        ``SCALES``), the host multiplier inside them, and the residual's deviation."""
        c = self.effective_coef
        return {"base_ms": c[0] * 1e3, "ms_per_1k_prefill_tokens": c[1] * 1e3,
                "ms_per_10_decode_seqs": c[2] * 1e3, "ms_per_10k_context_tokens": c[3] * 1e3,
                "ms_per_1m_attention_pairs": c[4] * 1e3, "scale": self.scale,
                "residual_sigma_ms": self.sigma_s * 1e3}
