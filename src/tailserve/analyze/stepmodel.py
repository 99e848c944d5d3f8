"""What a step should cost given its batch, and what it cost beyond that.

The features, the non-negative solver and the stall rule are the engine's own
(``tailserve.stepcost``: base + prefill tokens + decode sequences + context tokens the decodes
read + the prefill's causal attention pairs), fitted here once over the run's step records
rather than online; so "the batch explains it" and "the engine stalled" are told apart the same
way as the scheduler budgets its steps. Records from before the engine wrote the attention
columns get ``p(p+1)/2`` pairs (one prompt from its start) and no context term.

The prefill terms are the part charged to ``prefill_interference`` (to every request decoding
in that step). A step whose residual is far above what the batch explains is an
``engine_stall``: something outside the batch made it slow (GC, CPU contention, allocator).
Far above means the engine's rule (``stepcost.stall_excess``: 5 robust sigmas, twice the
prediction, 1 ms) *and* beyond the run's own step noise: ``STALL_NOISE_X`` times the residual
that 19 steps in 20 stay within (``noise_s``). A fitted sigma describes the bulk of the steps;
on a shared host a millisecond of jitter is many sigmas and still only the host's noise.

Window sums over steps use prefix sums and ``searchsorted``, so charging tens of thousands of
ITL gaps costs a few array operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tailserve.analyze.data import BLOCKED_KV, BLOCKED_PREEMPTION, Steps
from tailserve.stepcost import (
    FEATURES,
    STALL_MIN_S,
    STALL_REL,
    STALL_SIGMAS,
    features,
    solve_nonneg,
    stall_excess,
)

__all__ = ["FEATURES", "STALL_MIN_S", "STALL_REL", "STALL_SIGMAS", "StepModel",
           "WindowSums", "fit_step_model", "nonneg_lstsq"]

STALL_NOISE_X = 3.0
NOISE_QUANTILE = 95.0


@dataclass
class StepModel:
    coef: np.ndarray  # per stepcost.FEATURES (scaled units); dropped features are 0
    r2: float
    sigma_s: float  # robust standard deviation of the residual
    predicted: np.ndarray  # per step, seconds the batch explains
    prefill_part: np.ndarray  # per step, seconds explained by prefill tokens
    stall: np.ndarray  # per step, residual seconds when the step is a stall, else 0
    noise_s: float = 0.0  # |residual| that NOISE_QUANTILE % of the steps stay within

    def prefill_cost(self, tokens: np.ndarray | float) -> np.ndarray:
        """Seconds to prefill ``tokens`` of one prompt from its start, in one step."""
        t = np.asarray(tokens, dtype=float)
        x = features(t, 0.0, 0.0, t * (t + 1) / 2)
        return np.asarray(self.coef[1] * x[1] + self.coef[4] * x[4])

    def describe(self) -> dict[str, float]:
        c = self.coef
        return {"base_ms": c[0] * 1e3,
                "ms_per_decode_seq": float(features(0, 1, 0, 0)[2]) * c[2] * 1e3,
                "ms_per_1k_prefill_tokens": float(self.prefill_cost(1000.0)) * 1e3,
                "ms_per_10k_context_tokens": c[3] * 1e3,
                "ms_per_1m_attention_pairs": c[4] * 1e3,
                "r2": self.r2, "residual_sigma_ms": self.sigma_s * 1e3,
                "step_noise_ms": self.noise_s * 1e3}


def _design(steps: Steps) -> np.ndarray:
    p = steps.prefill
    cols = features(p, steps.decode, steps.context, steps.pairs)
    return np.column_stack([np.ones_like(p), *cols[1:]])


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient kept >= 0 (``stepcost.solve_nonneg`` on the
    normal equations); a constant column other than the first is left out."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != x[0, j]) or j == 0]
    return np.array(solve_nonneg((x.T @ x).tolist(), (x.T @ y).tolist(), active))


def fit_step_model(steps: Steps) -> StepModel:
    x, y = _design(steps), steps.step_s
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(x.shape[1])
    sigma = 0.0
    # Fit, drop the steps the stall rule calls stalls (they must not bend the fit), refit.
    # Only stalls are dropped: a long prefill is slow because of its batch, and dropping it
    # as an outlier would leave the quadratic term unfitted and call the next one a stall.
    for _ in range(4):
        coef = nonneg_lstsq(x[keep], y[keep])
        resid = y - x @ coef
        sigma = 1.4826 * float(np.median(np.abs(resid[keep] - np.median(resid[keep]))))
        new_keep = _stalls(x @ coef, y, sigma) == 0
        if new_keep.sum() < x.shape[1] + 2 or np.array_equal(new_keep, keep):
            break
        keep = new_keep
    pred = x @ coef
    resid = y - pred
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid[keep] ** 2)) / ss_tot if ss_tot > 0 else 1.0
    noise = float(np.percentile(np.abs(resid), NOISE_QUANTILE)) if len(resid) else 0.0
    stall = np.where(resid > STALL_NOISE_X * noise, _stalls(pred, y, sigma), 0.0)
    is_stall = stall > 0
    prefill = np.maximum(coef[1] * x[:, 1] + coef[4] * x[:, 4], 0.0)
    # A prefill step that is not a stall is slow because of its prefill: what it took beyond
    # the decode-only prediction is the prefill's, even where the fit falls short.
    decode_only = coef[0] + coef[2] * x[:, 2] + coef[3] * x[:, 3]
    prefill = np.where((steps.prefill > 0) & ~is_stall,
                       np.maximum(prefill, steps.step_s - decode_only), prefill)
    return StepModel(coef=coef, r2=r2, sigma_s=sigma, predicted=pred, prefill_part=prefill,
                     stall=stall, noise_s=noise)


def _stalls(pred: np.ndarray, actual: np.ndarray, sigma: float) -> np.ndarray:
    return np.array([stall_excess(float(p), float(a), sigma)
                     for p, a in zip(pred, actual, strict=True)])


class WindowSums:
    """Sums of per-step quantities over steps that *ended* in (t0, t1]."""

    def __init__(self, steps: Steps, model: StepModel | None) -> None:
        self.t = steps.t
        kv = np.array([b == BLOCKED_KV for b in steps.blocked_by], dtype=float)
        pre = np.array([b == BLOCKED_PREEMPTION for b in steps.blocked_by], dtype=float)
        free = np.array([b is None for b in steps.blocked_by], dtype=float)
        prefill = model.prefill_part if model else np.zeros(len(steps))
        cols = {"step_s": steps.step_s, "kv_blocked_s": kv * steps.step_s,
                "preempt_blocked_s": pre * steps.step_s,
                "prefill_s": prefill,
                # prefill time of steps that held nothing back: a request waiting through one
                # waited for someone's prefill, not for a slot, blocks or the token budget
                "prefill_unblocked_s": prefill * free,
                "stall_s": model.stall if model else np.zeros(len(steps))}
        self._cum = {k: np.concatenate([[0.0], np.cumsum(v)]) for k, v in cols.items()}

    def __call__(self, name: str, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
        cum = self._cum[name]
        i0 = np.searchsorted(self.t, np.asarray(t0, dtype=float), side="right")
        i1 = np.searchsorted(self.t, np.asarray(t1, dtype=float), side="right")
        return np.asarray(cum[np.maximum(i1, i0)] - cum[i0])
