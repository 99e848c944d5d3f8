"""A live server with --slo-ttft-ms and --enable-slo-admission: a burst of long prompts is
admitted up to what the SLO allows and the rest refused at once (429, Retry-After, the
prediction in the message, counted by reason in /metrics); and the step-time model predicts
this machine's steps within a generous bound (the median step within a factor of 2, steps
with prefill and decode-only steps each, though the machine is shared)."""

from __future__ import annotations

import math
import re
import statistics
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_util import ServerProcess

SLO_MS = 2000
# The step-time prediction's bound on a shared 2-core host: the median over the steps of
# |log(predicted / measured)| below log 2 (within a factor of 2, either way), taken over the
# steps with prefill tokens and over the decode-only steps separately, each with at least
# MIN_STEPS steps, and only on steps after the warm-up request. Why each part:
# - the steps are wall time on a host other processes load: one step can take 2-3x its
#   prediction for reasons the model cannot see (steps of 20-60 ms here, where waiting for a
#   core a few ms is a large part), so one step or a mean fails on noise; a median does not;
# - the log ratio is symmetric: |predicted - measured| / measured bounded a step twice as slow
#   as predicted at 0.5 but one twice as fast at 1.0, and load that eases off (steps faster
#   than the model, still tracking the slower host) is as common here as load that starts;
# - per class: the model over-predicts this model's decode-only steps (a linear fit whose
#   base also serves the mixed steps) until its multiplier adapts, so a pooled median hangs
#   on how many steps of each kind the burst's timing gave a run; per class, a model wrong on
#   prefill (or on decodes) fails however many steps of the other kind a run has;
# - the warm-up request's steps (right after start-up) are predicted from the synthetic
#   calibration alone, before the online model saw one real step: not what is bounded here;
# - prefill steps are sent one at a time before the burst too: a loaded host's burst admits
#   few prompts (5-8 prefill steps), too few for a median.
# Measured on the shared 2-core host with two more busy loops on both cores (3 runs): medians
# 0.19-0.32 (prefill steps) and 0.16-0.24 (decode-only). Broken on purpose, the recorded
# prediction without its prefill terms: 1.50 (prefill; on the same steps the pooled median,
# 0.46, passed, as did the old median |predicted - measured| / measured < 0.5, at 0.45);
# 2.5x too large: 0.74 and 1.07.
MAX_MEDIAN_ABS_LOG_RATIO = math.log(2)
MIN_STEPS = 8


@pytest.fixture(scope="module")
def heavy_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Wide enough that a 1,000-token prefill takes tens of ms or more (see test_diagnose)."""
    from tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("slo") / "llama", hidden_size=768,
                            intermediate_size=2048, num_hidden_layers=4,
                            num_attention_heads=12, num_key_value_heads=4,
                            max_position_embeddings=2048)


def test_ttft_slo_refusals_and_step_prediction_error(heavy_model_dir: str) -> None:
    args = ["--slo-ttft-ms", str(SLO_MS), "--enable-slo-admission", "--max-num-seqs", "8",
            "--kv-cache-memory", "0.5", "--max-model-len", "2048"]
    with ServerProcess(args, model=heavy_model_dir) as srv:
        def send(n_tokens: int, i: int = 0) -> httpx.Response:
            body = {"max_tokens": 4, "temperature": 0,
                    "prompt": [(7 * i + k) % 500 + 3 for k in range(n_tokens)]}
            return httpx.post(srv.url + "/v1/completions", json=body, timeout=300)

        def idle_ms(n: int) -> float:
            """The server's own prediction of an n-token prefill on an idle engine."""
            text = httpx.get(srv.url + "/metrics").text
            c = {m[0]: float(m[1]) for m in re.findall(
                r'tailserve:step_time_model\{term="(\w+)"\} (\S+)', text)}
            return (c["base_ms"] + c["ms_per_1k_prefill_tokens"] * n / 1e3
                    + c["ms_per_1m_attention_pairs"] * n * (n + 1) / 2e6)

        assert send(16).status_code == 200  # one step, so the model's gauges are out
        warm_up_end = max(r["t"] for r in httpx.get(srv.url + "/debug/timeline").json()
                          ["records"] if r["kind"] == "step")
        # Prefill steps whatever the burst below admits (fewer on a loaded host): one prompt at
        # a time, one step each (and 3 decode-only steps), before the burst's own contention.
        for i, k in enumerate((64, 128, 192, 256, 64, 128, 192, 256)):
            assert send(k, 100 + i).status_code == 200
        # Prompts whose own prefill is a quarter of the SLO on this host, now: 16 of them at
        # once need 4 SLOs of prefill, so the queue fills to the SLO and the rest is refused.
        n = max([16] + [k for k in range(16, 1900, 16) if idle_ms(k) < SLO_MS / 4])
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: send(n, i), range(16)))
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429}, (n, codes)
        assert codes.count(200) >= 1 and codes.count(429) >= 1, (n, codes)
        refused = next(r for r in results if r.status_code == 429)
        assert int(refused.headers["Retry-After"]) >= 1
        err = refused.json()["error"]
        assert err["code"] == "ttft_slo"
        m = re.search(r"predicted time to first token (\d+) ms exceeds the TTFT SLO of 2000 ms",
                      err["message"])
        assert m and int(m.group(1)) > SLO_MS, err["message"]
        # A prompt over the SLO even alone is a 400 (where this host is slow enough for a
        # prompt within max_model_len to be one; the fake-clock test pins it exactly).
        big = next((k for k in range(16, 2000, 16) if idle_ms(k) > 2 * SLO_MS), None)
        if big is not None:
            r = send(big)
            assert r.status_code == 400 and r.json()["error"]["code"] == "ttft_slo_unattainable"
            assert "even on an idle engine" in r.json()["error"]["message"]

        # Decode-only steps once the prefills are done: 4 sequences for 24 tokens.
        with ThreadPoolExecutor(4) as pool:
            decodes = list(pool.map(
                lambda i: httpx.post(srv.url + "/v1/completions", timeout=300, json={
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                    "prompt": [(11 * i + k) % 500 + 3 for k in range(16)]}), range(4)))
        assert [r.status_code for r in decodes] == [200] * 4

        metrics = httpx.get(srv.url + "/metrics").text
        n_refused = float(re.search(r'tailserve:requests_rejected_total\{reason="ttft_slo"\} '
                                    r"(\S+)", metrics).group(1))  # type: ignore[union-attr]
        assert n_refused == codes.count(429)
        if big is not None:
            assert 'tailserve:requests_rejected_total{reason="ttft_slo_unattainable"} 1.0' \
                in metrics
        assert re.search(r'tailserve:step_time_model\{term="base_ms"\} \S+', metrics)
        target = re.search(r"^tailserve:itl_target_seconds (\S+)$", metrics, re.M)
        assert target and float(target.group(1)) > 0  # the decodes' slack under the ITL SLO
        count = re.search(r"^tailserve:engine_step_predicted_seconds_count (\S+)$", metrics,
                          re.M)
        assert count and float(count.group(1)) > 0

        steps = [r for r in httpx.get(srv.url + "/debug/timeline").json()["records"]
                 if r["kind"] == "step" and r.get("predicted_s") is not None
                 and r["t"] > warm_up_end]
    for name, group in [("prefill", [s for s in steps if s["num_prefill_tokens"] > 0]),
                        ("decode-only", [s for s in steps if s["num_prefill_tokens"] == 0])]:
        errors = sorted(abs(math.log(max(s["predicted_s"], 1e-9) / s["step_s"]))
                        for s in group)
        assert len(errors) >= MIN_STEPS, (name, errors)
        assert statistics.median(errors) < MAX_MEDIAN_ABS_LOG_RATIO, (name, errors)
