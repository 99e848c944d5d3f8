"""``--replica URL`` (repeatable): load through a router, observation of every replica behind it.

``tailserve bench --base-url ROUTER --replica R0 --replica R1`` sends the load to the router
(``--base-url``) as any run does, and the observer process (observe.py) watches each replica
as it watches a single server: ``/metrics`` before, once per ``--metrics-interval`` during and
after the step, ``/health`` at the same moments, ``/debug/timeline`` over the run. The result's
``tailserve.replicas`` holds one observation per URL, in the order given, and every request
record a ``replica`` index (``None``: no replica recorded it).

Which replica served a request: the bench sends each request with its own ``x-request-id``;
vllm-router forwards that header to the worker it picks (as it forwards the worker's response
headers back), and a tailserve replica stamps the id on the request record its timeline keeps.
So a request belongs to the replica whose timeline holds a request record with its id. An id
found on two replicas (a router that retried on another worker) goes to the one whose record
finished last, the one that answered; it is counted as ``ambiguous``. A replica without
``/debug/timeline`` (not tailserve) contributes its ``/metrics`` but claims no request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tailserve.bench import BenchError
from tailserve.bench.observe import available_gauges
from tailserve.bench.preflight import SyncHTTP, normalize_base_url

METHOD = "x-request-id on the replica's timeline request records"


@dataclass(frozen=True)
class ReplicaInfo:
    url: str
    metrics: bool  # /metrics has gauges the observer keeps
    timeline: bool  # /debug/timeline answers (a tailserve replica)


def probe_replicas(urls: list[str], headers: dict[str, str]) -> list[ReplicaInfo]:
    """What each replica offers; a replica that is down or is not a server is a user mistake
    (a typo in the URL), said before any load is sent."""
    normalized = [normalize_base_url(u) for u in urls]
    for url in normalized:
        if normalized.count(url) > 1:
            raise BenchError(f"--replica {url} is given twice")
    out = []
    for url in normalized:
        http = SyncHTTP(url, headers, timeout_s=10.0)
        try:
            status, _ = http.request("GET", "/health")
            if status != 200:
                raise BenchError(f"GET /health answered HTTP {status}; is the replica up?")
            status, raw_metrics = http.request("GET", "/metrics")
            metrics = status == 200 and bool(
                available_gauges(raw_metrics.decode("utf-8", "replace")))
            status, body = http.get_json("/debug/timeline?limit=1")
            timeline = status == 200 and isinstance(body, dict) and "records" in body
        except BenchError as exc:
            raise BenchError(f"--replica {url}: {exc}") from None
        finally:
            http.close()
        out.append(ReplicaInfo(url, metrics, timeline))
    return out


@dataclass
class Attribution:
    replica: list[int | None]  # per request, in the order given
    matched: int
    unmatched: int
    ambiguous: int

    def summary(self) -> dict[str, Any]:
        return {"method": METHOD, "matched": self.matched, "unmatched": self.unmatched,
                "ambiguous": self.ambiguous}


def attribute_requests(request_ids: list[str],
                       timelines: list[list[dict[str, Any]] | None]) -> Attribution:
    """Each request's replica: the one whose timeline holds a request record with its id;
    on two, the one whose record is latest (``t``: when it finished)."""
    best: dict[str, tuple[float, int]] = {}
    where: dict[str, set[int]] = {}
    for i, records in enumerate(timelines):
        for r in records or []:
            if r.get("kind") != "request" or not r.get("request_id"):
                continue
            rid = str(r["request_id"])
            t = float(r.get("t") or 0.0)
            where.setdefault(rid, set()).add(i)
            if rid not in best or t > best[rid][0]:
                best[rid] = (t, i)
    replica: list[int | None] = [best[rid][1] if rid in best else None for rid in request_ids]
    ambiguous = sum(len(where.get(rid, ())) > 1 for rid in request_ids)
    matched = sum(r is not None for r in replica)
    return Attribution(replica, matched, len(replica) - matched, ambiguous)


def replicas_block(infos: list[ReplicaInfo], observations: list[dict[str, Any]],
                   requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Fill each request record's ``replica`` and return ``tailserve.replicas`` and the
    attribution summary (the result's ``replica_attribution``)."""
    ids = [str(r.get("request_id")) for r in requests]
    timelines = [obs.get("timeline") for obs in observations]
    att = attribute_requests(ids, timelines)
    for rec, rep in zip(requests, att.replica, strict=True):
        rec["replica"] = rep
    counts = [att.replica.count(i) for i in range(len(infos))]
    block = [{"index": i, "url": info.url, "metrics": info.metrics, "timeline": info.timeline,
              "num_requests": counts[i], **obs}
             for i, (info, obs) in enumerate(zip(infos, observations, strict=True))]
    return {"replicas": block, "replica_attribution": att.summary()}
