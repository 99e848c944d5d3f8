"""Per-tenant families of ``/metrics`` (docs/tenants.md): requests by outcome, TTFT and SLO
attainment labelled ``tenant``.

The label's values are bounded: the names of the keys file (``--api-keys``), ``default`` (no
key file, ``--api-key``'s single key, or a request no tenant was named for) and ``other`` for
any name outside them (a trusted proxy's header may name tenants the file does not know; a label
per name would be unbounded).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from prometheus_client import Counter, Histogram

from tailserve.data.records import RequestRecord

DEFAULT_LABEL = "default"
OVERFLOW_LABEL = "other"
# What became of a request: finished (stop, length, or ended by the API: abort), failed
# (an error of ours or the engine's), or refused before any work (4xx / 503).
OUTCOMES = ("success", "error", "rejected")
SLO_KINDS = ("ttft", "itl", "tpot")


class TenantMetrics:
    def __init__(self, counter: Callable[[str, str, tuple[str, ...]], Counter],
                 histogram: Callable[[str, str, tuple[float, ...], tuple[str, ...]], Histogram],
                 ttft_buckets: tuple[float, ...], names: Iterable[str] = ()) -> None:
        self.names = frozenset(names) | {DEFAULT_LABEL}
        self.requests = counter(
            "tenant_requests_total", "Requests by tenant and outcome (success, error, "
            "rejected).", ("tenant", "outcome"))
        self.time_to_first_token = histogram(
            "tenant_time_to_first_token_seconds", "Arrival to first token (engine clock), "
            "by tenant.", ttft_buckets, ("tenant",))
        self.slo_attained = counter(
            "tenant_slo_attained_total", "Finished requests that met an SLO, by tenant and "
            "part.", ("tenant", "slo"))
        self.slo_missed = counter(
            "tenant_slo_missed_total", "Finished requests that missed an SLO, by tenant and "
            "part.", ("tenant", "slo"))

    def label(self, tenant: str | None) -> str:
        if tenant is None:
            return DEFAULT_LABEL
        return tenant if tenant in self.names else OVERFLOW_LABEL

    def on_request_finished(self, rec: RequestRecord, success: bool) -> None:
        tenant = self.label(rec.tenant)
        self.requests.labels(tenant=tenant, outcome="success" if success else "error").inc()
        timing = rec.timing
        if timing is None:
            return
        ttft = timing.get("ttft_s")
        if isinstance(ttft, (int, float)):
            self.time_to_first_token.labels(tenant=tenant).observe(float(ttft))
        slo = timing.get("slo")
        if isinstance(slo, Mapping) and rec.abort_reason != "client_disconnect":
            for kind in SLO_KINDS:
                met = slo.get(f"{kind}_met")
                if met is not None:
                    (self.slo_attained if met else self.slo_missed).labels(
                        tenant=tenant, slo=kind).inc()

    def on_rejected(self, tenant: str | None) -> None:
        self.requests.labels(tenant=self.label(tenant), outcome="rejected").inc()
