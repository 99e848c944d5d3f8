"""Structured output's grammar cost made visible: the /metrics histograms of each compile and of
each constrained request's grammar time, and ``tailserve diagnose`` naming ``grammar`` when the
wait for a grammar makes the TTFT tail (a simulated run with cold schemas planted on a few
requests, against the same run where that wait is not a grammar's)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diagnose_sim import Sim, simulate
from tailserve.analyze.data import run_from_result
from tailserve.analyze.diagnose import diagnose
from tailserve.data.records import RequestRecord
from tailserve.obs.metrics import ServerMetrics


def _samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(m.render()[0].decode()):
        for s in family.samples:
            if not s.labels or s.labels.get("le") in ("0.02", "+Inf"):
                key = s.name + (f"@{s.labels['le']}" if s.labels else "")
                out[key] = s.value
    return out


def test_grammar_histograms_observe_compiles_and_constrained_requests_only() -> None:
    m = ServerMetrics()
    m.on_grammar_compiled(0.012)
    m.on_grammar_compiled(0.9)  # one that went past the limit, observed when it ended
    base = {"queue_s": 0.01, "ttft_s": 0.02, "e2e_s": 0.1, "decode_s": 0.08, "prefill_s": 0.01}
    for g in (0.0, 0.004, 0.03):
        m.on_request_finished(RequestRecord(t=1.0, request_id="r", finish_reason="stop",
                                            prompt_tokens=4, output_tokens=3,
                                            timing={**base, "grammar_s": g}))
    s = _samples(m)
    assert s["tailserve:grammar_compile_seconds_count"] == 2
    assert s["tailserve:grammar_compile_seconds_sum"] == pytest.approx(0.912)
    assert s["tailserve:grammar_compile_seconds_bucket@0.02"] == 1
    # The unconstrained request (grammar_s 0) is not observed.
    assert s["tailserve:request_grammar_time_seconds_count"] == 2
    assert s["tailserve:request_grammar_time_seconds_bucket@0.02"] == 1
    assert s["tailserve:request_grammar_time_seconds_sum"] == pytest.approx(0.034)


GRAMMAR_S = 0.4  # a cold, large schema's compile + first mask


def _plant(result: dict[str, Any], every: int | None, as_grammar: bool) -> dict[str, Any]:
    """Every ``every``-th request arrived GRAMMAR_S earlier than it was scheduled in the
    simulation and waited that long before it could queue: for its grammar (``grammar_s``)
    when ``as_grammar``, else for nothing the server names (the control). Every other request
    is constrained with a cached schema (0.2 ms of masks)."""
    res = copy.deepcopy(result)
    by_id = {r["request_id"]: r for r in res["tailserve"]["server"]["timeline"]
             if r.get("kind") == "request"}
    for q in res["tailserve"]["requests"]:
        planted = every is not None and q["index"] % every == 0
        g = GRAMMAR_S if planted else 0.0
        rec = by_id[q["request_id"]]
        # The simulator's record and timeline share one timing dict (deepcopy keeps that).
        for timing in {id(t): t for t in (q["server_timing"], rec["timing"])}.values():
            timing["grammar_s"] = (g if as_grammar else 0.0) + 0.0002
            for key in ("queue_s", "ttft_s", "e2e_s"):
                timing[key] += g
        q["send_s"] -= g
        q["scheduled_s"] -= g
        q["ttft_s"] += g
        q["e2el_s"] += g
        rec["arrival_time"] -= g
    return res


def test_diagnose_names_grammar_when_cold_schemas_make_the_ttft_tail() -> None:
    clean = simulate(Sim(n=300, rate=5, seed=11))
    d = diagnose(run_from_result(_plant(clean, every=25, as_grammar=True)))
    ttft = d.tails["ttft"]
    assert ttft.causes[0].cause == "grammar", d.as_json()["tail"]["ttft"]
    assert ttft.causes[0].share > 0.8
    ev = ttft.causes[0].evidence
    assert ev["constrained_requests"] == 300
    assert ev["tail_grammar_max_ms"] == round((GRAMMAR_S + 0.0002) * 1e3, 3)
    assert ev["grammar_p50_ms"] == 0.2
    assert "--grammar-timeout-ms" in ttft.causes[0].advice
    assert any("of the tail is grammar" in f for f in d.findings)
    # Decoding never waited for a grammar: its causes are not grammar's.
    assert "grammar" not in {c.cause for m in ("itl", "tpot") for c in d.tails[m].causes}
    assert d.as_json()["tail"]["ttft"]["causes"][0]["cause"] == "grammar"

    # The same waits with no grammar time behind them stay queue time.
    control = diagnose(run_from_result(_plant(clean, every=25, as_grammar=False)))
    causes = {c.cause: c.share for c in control.tails["ttft"].causes}
    assert "grammar" not in causes and max(causes, key=causes.__getitem__) == "queueing"


def test_a_cached_schema_on_every_request_is_no_cause() -> None:
    # test_diagnose's clean run, every request constrained by a schema compiled long ago.
    d = diagnose(run_from_result(_plant(simulate(Sim(n=200, rate=5, seed=6)), every=None,
                                        as_grammar=True)))
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert [c.cause for c in d.tails[m].causes] == ["none"], m
