"""A request's own SLO from its headers and body (server/slo.py), and what /metrics makes of
each finished request's SLO attainment (obs/metrics.py)."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.datastructures import Headers

from tailserve.data.records import RequestRecord
from tailserve.data.step import StepStats
from tailserve.obs.metrics import ServerMetrics
from tailserve.request import SLO
from tailserve.server.errors import APIError
from tailserve.server.slo import request_slo


def headers(**kw: str) -> Headers:
    return Headers({k.replace("_", "-"): v for k, v in kw.items()})


def test_headers_as_llm_ds_gateway_sends_them() -> None:
    h = headers(x_slo_ttft_ms="800", x_slo_tpot_ms="40.5")
    assert request_slo(h, None) == SLO(0.8, None, 0.0405)
    assert request_slo(headers(x_slo_itl_ms=" 120 "), None) == SLO(None, 0.12, None)
    # Header names are case-insensitive; unknown x-slo-* headers are ignored.
    assert request_slo(Headers({"X-SLO-TTFT-MS": "500", "x-slo-e2e-ms": "abc"}), None) == \
        SLO(0.5, None, None)
    assert request_slo(headers(), None) == SLO()


def test_the_body_extension_wins_over_headers() -> None:
    h = headers(x_slo_ttft_ms="800", x_slo_itl_ms="100")
    assert request_slo(h, {"ttft_ms": 300, "tpot_ms": 25, "e2e_ms": 9}) == SLO(0.3, 0.1, 0.025)
    assert request_slo(headers(), {"itl_ms": None}) == SLO()


@pytest.mark.parametrize(("where", "value"), [
    ("x-slo-ttft-ms", "0"), ("x-slo-ttft-ms", "-5"), ("x-slo-ttft-ms", "fast"),
    ("x-slo-ttft-ms", "nan"), ("x-slo-ttft-ms", "1e12"), ("x-slo-tpot-ms", "inf"),
    ("x-slo-itl-ms", ""), ("x-slo-itl-ms", "90000"),
])
def test_a_bad_header_is_a_400_naming_it_and_its_value(where: str, value: str) -> None:
    with pytest.raises(APIError) as exc:
        request_slo(Headers({where: value}), None)
    assert exc.value.status == 400 and exc.value.param == where
    assert f"{where} must be milliseconds in (0, " in exc.value.message
    assert f"got {value!r}" in exc.value.message


@pytest.mark.parametrize(("body", "param"), [
    ({"ttft_ms": 0}, "slo.ttft_ms"), ({"itl_ms": -1}, "slo.itl_ms"),
    ({"tpot_ms": "soon"}, "slo.tpot_ms"), ({"ttft_ms": True}, "slo.ttft_ms"),
    ([100], "slo"), ("100", "slo"),
])
def test_a_bad_body_slo_is_a_400_naming_it(body: object, param: str) -> None:
    with pytest.raises(APIError) as exc:
        request_slo(headers(), body)
    assert exc.value.status == 400 and exc.value.param == param, exc.value.message


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = m.render()[0].decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _finished(priority: int, ttft: bool, itl: bool | None, tpot: bool | None,
              abort_reason: str | None = None) -> RequestRecord:
    slo = {"ttft_s": 1.0, "itl_s": 0.1, "tpot_s": 0.05, "ttft_met": ttft, "itl_met": itl,
           "tpot_met": tpot}
    return RequestRecord(t=0.0, request_id="r", finish_reason="length", prompt_tokens=10,
                         output_tokens=4, timing={"ttft_s": 0.5, "slo": slo},
                         priority=priority, abort_reason=abort_reason)


def test_metrics_count_attainment_by_slo_and_priority_and_show_the_slack() -> None:
    m = ServerMetrics()
    m.on_slo_config(ttft_s=1.0, itl_s=0.1)
    m.on_request_finished(_finished(0, True, True, None))
    m.on_request_finished(_finished(0, False, True, False))
    m.on_request_finished(_finished(1000, True, False, True))  # priority out of range
    m.on_request_finished(_finished(0, False, False, False, abort_reason="client_disconnect"))
    m.on_step(StepStats(t=0.0, step_s=0.01, num_prefill_tokens=0, num_decode_seqs=2,
                        num_scheduled_seqs=2, num_running=2, num_waiting=0, free_blocks=1,
                        total_blocks=2, num_preemptions=0, prefix_cache_queries=0,
                        prefix_cache_hits=0, num_finished=0, min_decode_slack_s=0.093))
    s = _samples(m)

    def count(name: str, slo: str, priority: str) -> float:
        return s.get((f"tailserve:{name}_total", (("priority", priority), ("slo", slo))), 0.0)

    assert s[("tailserve:slo_ttft_seconds", ())] == 1.0
    assert s[("tailserve:slo_itl_seconds", ())] == 0.1
    assert (count("slo_attained", "ttft", "0"), count("slo_missed", "ttft", "0")) == (1, 1)
    assert (count("slo_attained", "itl", "0"), count("slo_missed", "itl", "0")) == (2, 0)
    assert (count("slo_attained", "tpot", "0"), count("slo_missed", "tpot", "0")) == (0, 1)
    assert count("slo_missed", "itl", "other") == 1 and count("slo_attained", "tpot", "other") == 1
    assert s[("tailserve:min_decode_slack_seconds", ())] == 0.093
    # Without an ITL SLO there is no gauge for it.
    m2 = ServerMetrics()
    m2.on_slo_config(ttft_s=1.0, itl_s=None)
    assert ("tailserve:slo_itl_seconds", ()) not in _samples(m2)
