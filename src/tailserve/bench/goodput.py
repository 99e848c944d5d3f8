"""Service-level objectives and goodput, as DistServe defines it, measured by the client.

A request *meets its SLOs* when it completed and every SLO given holds for it, measured on the
client's own clock (so the same rule judges any OpenAI-compatible server):

- TTFT: send -> first content chunk <= ``ttft_ms``;
- ITL: *every* gap between two content chunks <= ``itl_ms`` (the worst gap, not the mean: a
  reader sees the stall);
- TPOT: the mean gap after the first token, (E2EL - TTFT) / (output tokens - 1), <= ``tpot_ms``
  (a one-token request has no gap: TPOT 0, as vLLM counts it);
- E2EL: send -> response complete <= ``e2el_ms`` (vLLM's ``--goodput e2el:MS``).

The *goodput share* (SLO attainment) is requests meeting every SLO / requests sent (a failed
request meets none); *goodput* in requests/s is that count over the step's duration.

Where the SLOs come from: the client's flags (``--slo-ttft-ms``, ``--slo-itl-ms``,
``--slo-tpot-ms``, or vLLM's ``--goodput NAME:MS``) first; else the defaults a tailserve server
publishes on /metrics (``tailserve:slo_ttft_seconds``, ``tailserve:slo_itl_seconds``); else
none and no goodput is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tailserve.bench import BenchError
from tailserve.errors import check_slo_ms

SLO_KINDS = ("ttft", "itl", "tpot", "e2el")
# The server's default SLOs as it publishes them (gauges in seconds; 0 or absent: unset).
SERVER_SLO_GAUGES = {"ttft": "tailserve:slo_ttft_seconds", "itl": "tailserve:slo_itl_seconds"}


@dataclass(frozen=True)
class SloSpec:
    """What a request must meet, in milliseconds; None: not judged."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None
    source: str = "client"  # "client": the bench's flags; "server": the server's /metrics

    def __post_init__(self) -> None:
        for kind in SLO_KINDS:
            v = getattr(self, f"{kind}_ms")
            if v is not None:
                check_slo_ms(f"--slo-{kind}-ms", v, BenchError)

    @classmethod
    def from_ms(cls, slos: dict[str, float], source: str = "client") -> SloSpec:
        """From kind -> milliseconds (vLLM's ``--goodput`` parsed, the server's gauges)."""
        unknown = set(slos) - set(SLO_KINDS)
        if unknown:
            raise BenchError(f"unknown SLO kinds {sorted(unknown)}: one of {SLO_KINDS}")
        return cls(ttft_ms=slos.get("ttft"), itl_ms=slos.get("itl"), tpot_ms=slos.get("tpot"),
                   e2el_ms=slos.get("e2el"), source=source)

    @property
    def given(self) -> dict[str, float]:
        """The SLOs set, kind -> milliseconds, in SLO_KINDS order."""
        return {k: v for k in SLO_KINDS if (v := getattr(self, f"{k}_ms")) is not None}

    def __bool__(self) -> bool:
        return bool(self.given)

    def describe(self) -> str:
        names = {"ttft": "TTFT", "itl": "every gap", "tpot": "TPOT", "e2el": "E2EL"}
        return " and ".join(f"{names[k]} <= {v:g} ms" for k, v in self.given.items())

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def resolve_slos(ttft_ms: float | None, itl_ms: float | None, tpot_ms: float | None,
                 goodput: dict[str, float] | None,
                 published: dict[str, float] | None = None) -> SloSpec:
    """The SLOs a run judges: the client's (``--slo-*-ms`` and vLLM's ``--goodput``, which
    must agree where both name one kind), else the server's published ones (kind -> ms)."""
    client: dict[str, float] = dict(goodput or {})
    for kind, v in (("ttft", ttft_ms), ("itl", itl_ms), ("tpot", tpot_ms)):
        if v is None:
            continue
        if kind in client and client[kind] != v:
            raise BenchError(f"--slo-{kind}-ms {v:g} and --goodput {kind}:{client[kind]:g} "
                             "disagree: give the SLO once")
        client[kind] = v
    if client:
        return SloSpec.from_ms(client, "client")
    if published:
        return SloSpec.from_ms(published, "server")
    return SloSpec()


def published_slos(metrics: dict[str, float]) -> dict[str, float]:
    """The server's default SLOs from its /metrics samples (name -> value, seconds), in ms;
    a gauge at 0 (or not a positive finite number) means that SLO is unset."""
    out = {}
    for kind, name in SERVER_SLO_GAUGES.items():
        # Labelled or not (``name{model_name="m"}``): the first sample of that name.
        v = next((x for key, x in metrics.items() if key.split("{", 1)[0] == name), None)
        if v is not None and 0 < v < float("inf"):
            out[kind] = v * 1000.0
    return out


@dataclass(frozen=True)
class Verdict:
    """One request against the SLOs: each kind met (True/False) or not judged (None)."""

    ok: bool  # completed
    ttft: bool | None
    itl: bool | None
    tpot: bool | None
    e2el: bool | None

    @property
    def good(self) -> bool:
        return self.ok and all(m is not False for m in (self.ttft, self.itl, self.tpot,
                                                        self.e2el))

    @property
    def missed(self) -> list[str]:
        """The kinds missed ("failed" for a request that did not complete)."""
        if not self.ok:
            return ["failed"]
        return [k for k in SLO_KINDS if getattr(self, k) is False]


def judge(spec: SloSpec, ok: bool, ttft_s: float | None, itl_s: Sequence[float],
          output_tokens: int | None, e2el_s: float | None) -> Verdict:
    """One request's verdict (module docstring). ``itl_s``: the gaps between its chunks."""
    ok = ok and ttft_s is not None

    def met(limit_ms: float | None, value_s: float | None) -> bool | None:
        if limit_ms is None:
            return None
        return ok and value_s is not None and value_s * 1000.0 <= limit_ms

    tpot = None
    if ok and ttft_s is not None:
        n = output_tokens or 0
        tpot = (e2el_s - ttft_s) / (n - 1) if e2el_s is not None and n >= 2 else 0.0
    worst = max(itl_s, default=0.0) if ok else None
    return Verdict(ok, met(spec.ttft_ms, ttft_s), met(spec.itl_ms, worst),
                   met(spec.tpot_ms, tpot), met(spec.e2el_ms, e2el_s))


@dataclass(frozen=True)
class Goodput:
    """A step's goodput against one ``SloSpec``."""

    slos: SloSpec
    num_sent: int
    num_good: int
    missed: dict[str, int]  # kind -> requests that missed it (a request may miss several)
    num_failed: int
    duration_s: float

    @property
    def share(self) -> float | None:
        """Requests meeting every SLO / requests sent (SLO attainment); None: none sent."""
        return self.num_good / self.num_sent if self.num_sent else None

    @property
    def rate(self) -> float | None:
        """Requests meeting every SLO per second of the step."""
        return self.num_good / self.duration_s if self.duration_s > 0 else None

    def as_json(self) -> dict[str, Any]:
        return {**self.slos.as_json(), "num_sent": self.num_sent, "num_good": self.num_good,
                "goodput_share": self.share, "request_goodput": self.rate,
                "missed": self.missed, "num_failed": self.num_failed}


def goodput(spec: SloSpec, verdicts: Sequence[Verdict], duration_s: float) -> Goodput:
    missed = {k: sum(getattr(v, k) is False for v in verdicts if v.ok) for k in spec.given}
    return Goodput(spec, len(verdicts), sum(v.good for v in verdicts), missed,
                   sum(not v.ok for v in verdicts), duration_s)
