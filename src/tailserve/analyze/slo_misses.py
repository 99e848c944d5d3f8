"""Which requests missed which SLO, and why: the tail section of ``tailserve diagnose`` for
SLOs, where the percentile tail (attribution.py) is replaced by the samples that missed.

A request's SLOs, first found wins: the ones given to diagnose (``--slo-ttft-ms`` ...); the
ones its bench run judged (the result's ``goodput`` block); the request's own, as the server
stamped them in its ``tailserve_timing.slo`` (per-request headers may differ per request).
Each request is judged on the client's clock as the bench judges it (bench/goodput.py): TTFT,
every ITL gap, TPOT (mean gap), E2EL.

The misses of one kind are split into causes exactly as a tail is (attribution.split, over
the missed samples instead of the samples above a percentile): TTFT, TPOT and E2EL by the
missed requests' samples; ITL by the gaps that exceeded the SLO (a request misses ITL by its
worst gaps, and those are what a cause must explain). Each missed request is listed with its
values and the cause that holds most of each miss (``unexplained`` where none does).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tailserve.analyze.attribution import CauseShare, reference, split
from tailserve.analyze.data import Req, RunData
from tailserve.analyze.samples import Samples
from tailserve.bench.goodput import SLO_KINDS, SloSpec, judge

NAMES = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2el": "E2EL"}


@dataclass
class MissedKind:
    kind: str
    num_requests: int  # requests that missed it
    num_samples: int  # samples attributed: requests, or for ITL the gaps over the SLO
    causes: list[CauseShare]
    unexplained_share: float

    def as_json(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "num_samples": self.num_samples,
                "causes": [{"cause": c.cause, "share": round(c.share, 4)} for c in self.causes],
                "unexplained_share": round(self.unexplained_share, 4)}


@dataclass
class SloMisses:
    source: str  # "flags" | "bench run" | "server timing"
    slos_ms: dict[str, float] | None  # one set for all; None: per request (server timing)
    num_requests: int
    num_good: int
    num_failed: int
    kinds: dict[str, MissedKind]
    requests: list[dict[str, Any]] = field(default_factory=list)  # each missed request

    @property
    def share(self) -> float:
        return self.num_good / self.num_requests if self.num_requests else 0.0

    def as_json(self) -> dict[str, Any]:
        return {"source": self.source, "slos_ms": self.slos_ms,
                "num_requests": self.num_requests, "num_good": self.num_good,
                "goodput_share": round(self.share, 4), "num_failed": self.num_failed,
                "missed": {k: m.as_json() for k, m in self.kinds.items()},
                "requests": self.requests}

    def sentence(self) -> str:
        slos = (", ".join(f"{NAMES[k]} <= {v:g} ms" for k, v in self.slos_ms.items())
                if self.slos_ms else "each request's own SLOs")
        parts = []
        for k, m in self.kinds.items():
            why = ", ".join(f"{c.cause} {c.share:.0%}" for c in m.causes[:3]) or "unexplained"
            parts.append(f"{m.num_requests} missed {NAMES[k]} ({why})")
        failed = f"; {self.num_failed} failed" if self.num_failed else ""
        return (f"SLOs ({slos}, from the {self.source}): {self.num_good} of {self.num_requests} "
                f"requests met every one ({self.share:.0%})"
                + (": " + "; ".join(parts) if parts else "") + failed + ".")


def request_slos(q: Req, given: dict[str, float] | None) -> dict[str, float]:
    """The SLOs (kind -> ms) one request is judged by (module docstring)."""
    if given:
        return given
    stamped = (q.timing or {}).get("slo") or {}
    return {k: 1000.0 * float(v) for k in SLO_KINDS
            if isinstance(v := stamped.get(f"{k}_s"), (int, float)) and v > 0}


def slo_misses(run: RunData, samples: dict[str, Samples],
               given: dict[str, float] | None = None) -> SloMisses | None:
    """None when no SLO is known for any request."""
    source = "flags" if given else "bench run" if run.slos_ms else "server timing"
    common = given or run.slos_ms or None
    per_req = [request_slos(q, common) for q in run.requests]
    if not any(per_req):
        return None
    verdicts = [judge(SloSpec.from_ms(s), q.ok, q.ttft_s, q.itl_s, q.output_tokens, q.e2el_s)
                for q, s in zip(run.requests, per_req, strict=True)]
    kinds_seen = [k for k in SLO_KINDS if any(k in s for s in per_req)]
    missed_by: dict[str, set[int]] = {
        k: {i for i, v in enumerate(verdicts) if v.ok and getattr(v, k) is False}
        for k in kinds_seen}
    out = SloMisses(source, common, len(run.requests), sum(v.good for v in verdicts),
                    sum(not v.ok for v in verdicts), {})
    top: dict[tuple[int, str], str] = {}
    for k in kinds_seen:
        if not missed_by[k]:
            continue
        s = samples.get(k)
        idx = np.zeros(0, dtype=int)
        if s is not None and len(s.values):
            if k == "itl":
                limit = np.array([per_req[int(r)].get("itl", np.inf) for r in s.req])
                idx = np.flatnonzero(s.values * 1000.0 > limit)
            else:
                idx = np.flatnonzero(np.isin(s.req, sorted(missed_by[k])))
        causes: list[CauseShare] = []
        unexplained = 1.0
        if len(idx) and s is not None:
            base, whole_run = reference(s)
            causes, unexplained = split(s, idx, base, whole_run)
            _top_causes(k, s, idx, causes, top)
        out.kinds[k] = MissedKind(k, len(missed_by[k]), len(idx), causes, unexplained)
    for i, (q, v) in enumerate(zip(run.requests, verdicts, strict=True)):
        if v.good:
            continue
        row: dict[str, Any] = {"request_id": q.request_id, "missed": v.missed,
                               "slos_ms": per_req[i], "prompt_tokens": q.prompt_len}
        if v.ok:
            row |= {"ttft_ms": _ms(q.ttft_s), "max_itl_ms": _ms(max(q.itl_s, default=0.0)),
                    "tpot_ms": _ms(q.tpot_s), "e2el_ms": _ms(q.e2el_s),
                    "causes": {k: top.get((i, k), "unexplained") for k in v.missed}}
        else:
            row["error_type"] = q.error_type
        out.requests.append(row)
    return out


def _top_causes(kind: str, s: Samples, idx: np.ndarray, causes: list[CauseShare],
                top: dict[tuple[int, str], str]) -> None:
    """For each request of ``idx``'s samples, the cause holding most of its (worst) miss."""
    worst: dict[int, tuple[float, str]] = {}
    for p, j in enumerate(idx):
        r = int(s.req[j])
        best = max(causes, key=lambda c: c.seconds[p], default=None)
        name = best.cause if best is not None and best.seconds[p] > 0 else "unexplained"
        if r not in worst or s.values[j] > worst[r][0]:
            worst[r] = (float(s.values[j]), name)
    for r, (_, name) in worst.items():
        top[(r, kind)] = name


def _ms(v: float | None) -> float | None:
    return None if v is None else round(1000.0 * v, 3)


def print_misses(m: SloMisses, console: Any, limit: int = 10) -> None:
    from rich.table import Table

    console.print(f"[bold]SLO misses[/]: {m.sentence()}")
    if not m.kinds:
        return
    t = Table(title="why the misses happened (share of the time over the reference)",
              title_justify="left")
    t.add_column("SLO")
    t.add_column("requests", justify="right")
    t.add_column("causes")
    for k, mk in m.kinds.items():
        why = ", ".join(f"{c.cause} {c.share:.0%}" for c in mk.causes)
        if mk.unexplained_share >= 0.05:
            why += f"{', ' if why else ''}(unexplained) {mk.unexplained_share:.0%}"
        t.add_row(NAMES[k], str(mk.num_requests), why or "-")
    console.print(t)
    rows = [r for r in m.requests if "causes" in r]
    if rows:
        r = Table(title=f"missed requests (the {min(limit, len(rows))} with the longest TTFT of "
                  f"{len(rows)})", title_justify="left")
        for col in ("request", "missed", "TTFT ms", "max gap ms", "TPOT ms", "prompt", "cause"):
            r.add_column(col, justify="left" if col in ("request", "missed", "cause")
                         else "right")
        for row in sorted(rows, key=lambda x: -(x["ttft_ms"] or 0.0))[:limit]:
            r.add_row(row["request_id"], ",".join(row["missed"]), _f(row["ttft_ms"]),
                      _f(row["max_itl_ms"]), _f(row["tpot_ms"]), str(row["prompt_tokens"]),
                      ", ".join(f"{NAMES[k]}: {c}" for k, c in row["causes"].items()))
        console.print(r)


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:,.1f}"
