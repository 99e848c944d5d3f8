"""What a step should cost given its batch, and what it cost beyond that.

    step_s ≈ a + b·decode_seqs + c·prefill_tokens + d·prefill_tokens²/1000

fitted by least squares over the run's step records. The prefill terms are the part charged
to ``prefill_interference`` (to every request decoding in that step; the quadratic term is
attention over a long prompt, which a straight line would leave in the residual and miscall
a stall). A step whose residual is far above what the batch explains is an ``engine_stall``:
the batch did not make it slow, something outside it did (GC, CPU contention, allocator).

Window sums over steps use prefix sums and ``searchsorted``, so charging tens of thousands of
ITL gaps costs a few array operations.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tailserve.analyze.data import BLOCKED_KV, BLOCKED_PREEMPTION, Steps

# A residual is a stall when it is this many robust standard deviations above the fit, more
# than the predicted step itself (the step took over twice what its batch explains), and at
# least STALL_MIN_S: noise on a 1 ms step is not a stall, and a big prefill step's ordinary
# wobble (attention over long contexts, which the token counts do not see) is not one either.
STALL_SIGMAS = 5.0
STALL_REL = 1.0
STALL_MIN_S = 1e-3
FEATURES = ("intercept", "decode_seqs", "prefill_tokens", "prefill_tokens_sq_per_1k")


@dataclass
class StepModel:
    coef: np.ndarray  # per FEATURES; dropped features are 0
    r2: float
    sigma_s: float  # robust standard deviation of the residual
    prefill_part: np.ndarray  # per step, seconds explained by prefill tokens
    stall: np.ndarray  # per step, residual seconds when the step is a stall, else 0

    def prefill_cost(self, tokens: np.ndarray | float) -> np.ndarray:
        t = np.asarray(tokens, dtype=float)
        return np.asarray(self.coef[2] * t + self.coef[3] * t * t / 1000.0)

    def describe(self) -> dict[str, float]:
        return {"base_ms": self.coef[0] * 1e3, "ms_per_decode_seq": self.coef[1] * 1e3,
                "ms_per_1k_prefill_tokens": float(self.prefill_cost(1000.0)) * 1e3,
                "r2": self.r2, "residual_sigma_ms": self.sigma_s * 1e3}


def _design(steps: Steps) -> np.ndarray:
    p = steps.prefill
    return np.column_stack([np.ones_like(p), steps.decode, p, p * p / 1000.0])


def nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient kept >= 0 (a negative cost per token would charge
    prefill with negative time, a negative base makes small steps look like stalls): drop
    the most negative term and refit until none is."""
    active = [j for j in range(x.shape[1]) if np.any(x[:, j] != x[0, j]) or j == 0]
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        neg = [(v, j) for v, j in zip(sol, active, strict=True) if v < 0]
        if not neg:
            coef[:] = 0.0
            coef[active] = sol
            return coef
        active.remove(min(neg)[1])
    return coef


def fit_step_model(steps: Steps) -> StepModel:
    x, y = _design(steps), steps.step_s
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(x.shape[1])
    sigma = 0.0
    # Fit, drop gross outliers (the stalls we are looking for must not bend the fit), refit.
    for _ in range(3):
        coef = nonneg_lstsq(x[keep], y[keep])
        resid = y - x @ coef
        sigma = 1.4826 * float(np.median(np.abs(resid[keep] - np.median(resid[keep]))))
        new_keep = resid <= max(STALL_SIGMAS * sigma, STALL_MIN_S)
        if new_keep.sum() < x.shape[1] + 2 or np.array_equal(new_keep, keep):
            break
        keep = new_keep
    pred = x @ coef
    resid = y - pred
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid[keep] ** 2)) / ss_tot if ss_tot > 0 else 1.0
    typical = float(np.median(y))
    is_stall = ((resid > STALL_SIGMAS * sigma) & (resid > STALL_REL * np.maximum(pred, typical))
                & (resid > STALL_MIN_S))
    prefill = np.maximum(coef[2] * steps.prefill + coef[3] * steps.prefill ** 2 / 1000.0, 0.0)
    # A prefill step that is not a stall is slow because of its prefill: what it took beyond
    # the decode-only prediction is the prefill's, even where the token-count fit falls short
    # (long prompts cost more than their count says when decodes attend to long contexts too).
    decode_only = coef[0] + coef[1] * steps.decode
    prefill = np.where((steps.prefill > 0) & ~is_stall,
                       np.maximum(prefill, steps.step_s - decode_only), prefill)
    return StepModel(coef=coef, r2=r2, sigma_s=sigma, prefill_part=prefill,
                     stall=np.where(is_stall, resid, 0.0))


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
