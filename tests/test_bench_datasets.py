"""tailserve bench without a server: arrivals, datasets, token lengths, metric arithmetic."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tailserve.bench import BenchError
from tailserve.bench.client import RequestResult, build_payload, describe_http_error
from tailserve.bench.config import parse_goodput, parse_percentiles
from tailserve.bench.datasets import (
    BenchRequest,
    DatasetOptions,
    load_dataset,
    parse_mix,
    sharegpt_pairs,
)
from tailserve.bench.metrics import (
    client_summary,
    compute_metrics,
    max_concurrency,
    p_word,
)
from tailserve.bench.observe import parse_metrics
from tailserve.bench.open_loop import arrival_times
from tailserve.bench.tokens import LocalCounter, PromptSynth


class WordCounter:
    """One token per whitespace-separated word: exact, instant, and easy to reason about."""

    exact = True
    source = "words"

    def __init__(self) -> None:
        self.calls = 0

    def count(self, text: str) -> int:
        self.calls += 1
        return len(text.split())


# ---------------------------------------------------------------- arrivals
@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrivals_match_rate_and_burstiness(burstiness: float) -> None:
    """Gamma gaps with shape b and mean 1/rate: mean rate = rate, gap CV = 1/sqrt(b). With
    n = 20000 gaps the standard error of the mean gap is CV/sqrt(n) < 1.5 %, so a 4 % bound
    is ~3 sigma for b = 0.25 and tighter for the others; the seed makes it deterministic."""
    rate, n = 8.0, 20001
    t = arrival_times(n, rate, burstiness, np.random.default_rng(1234))
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert (n - 1) / t[-1] == pytest.approx(rate, rel=0.04)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrivals_burstier_means_more_short_gaps() -> None:
    rng = np.random.default_rng(0)
    bursty = np.diff(arrival_times(5001, 10.0, 0.25, rng))
    steady = np.diff(arrival_times(5001, 10.0, 4.0, rng))
    # Fraction of gaps under a tenth of the mean gap: a burst is many of those in a row.
    assert (bursty < 0.01).mean() > 0.3 > 0.01 > (steady < 0.01).mean()


def test_arrivals_infinite_rate_and_errors() -> None:
    assert arrival_times(5, float("inf"), 1.0, np.random.default_rng(0)).tolist() == [0.0] * 5
    assert arrival_times(1, 3.0, 1.0, np.random.default_rng(0)).tolist() == [0.0]
    with pytest.raises(BenchError, match="request-rate"):
        arrival_times(5, 0.0, 1.0, np.random.default_rng(0))
    with pytest.raises(BenchError, match="burstiness"):
        arrival_times(5, 1.0, 0.0, np.random.default_rng(0))


# ---------------------------------------------------------------- synthetic datasets
def test_prompt_synth_hits_exact_lengths_with_the_real_tokenizer(tiny_model_dir: str) -> None:
    from tailserve.model.loader import load_tokenizer

    counter = LocalCounter(load_tokenizer(tiny_model_dir), "tiny")
    synth = PromptSynth(counter, np.random.default_rng(0))
    for n in (1, 2, 7, 64, 300, 1000):
        text, count = synth.text(n)
        assert count == n == counter.count(text)


def test_random_dataset_lengths_and_determinism() -> None:
    opts = DatasetOptions(name="random", num_prompts=50, input_len=40, output_len=10,
                          range_ratio=0.5, seed=3)
    ds = load_dataset(opts, WordCounter())
    assert len(ds.requests) == 50
    for r in ds.requests:
        assert 20 <= r.prompt_len <= 60 and r.prompt_len == len(r.prompt.split())
        assert 5 <= r.output_len <= 15
    assert len({r.prompt_len for r in ds.requests}) > 10
    again = load_dataset(opts, WordCounter())
    assert [r.prompt for r in again.requests] == [r.prompt for r in ds.requests]
    other = load_dataset(DatasetOptions(**{**opts.__dict__, "seed": 4}), WordCounter())
    assert other.requests[0].prompt != ds.requests[0].prompt


def test_mixed_dataset_follows_the_mixture() -> None:
    assert parse_mix("128:0.7,1024/256:0.2,8192:0.1", 64) == [
        (128, 64, pytest.approx(0.7)), (1024, 256, pytest.approx(0.2)),
        (8192, 64, pytest.approx(0.1))]
    assert parse_mix("10:1,20:3", 5) == [(10, 5, 0.25), (20, 5, 0.75)]
    ds = load_dataset(DatasetOptions(name="mixed", num_prompts=400, mix="8:0.75,64/3:0.25",
                                     output_len=7, seed=1), WordCounter())
    lens = Counter((r.prompt_len, r.output_len) for r in ds.requests)
    assert set(lens) == {(8, 7), (64, 3)}
    assert lens[(8, 7)] / 400 == pytest.approx(0.75, abs=0.06)
    for bad in ("128", "a:1", "128:0", "0:1", "128:0.5,"):
        with pytest.raises(BenchError, match="--mix"):
            parse_mix(bad, 10)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_prefix_dataset_shares_prefixes(endpoint: str) -> None:
    ds = load_dataset(DatasetOptions(name="prefix", num_prompts=40, prefix_len=30,
                                     num_prefixes=3, input_len=10, output_len=4,
                                     endpoint=endpoint, seed=0), WordCounter())
    prefixes = {" ".join(r.prompt.split()[:30]) for r in ds.requests}
    assert len(prefixes) == 3
    assert len({r.prompt for r in ds.requests}) == 40  # every request its own suffix
    for r in ds.requests:
        assert r.prompt_len == 40
        if endpoint == "chat":
            msgs = r.chat_messages()
            assert [m["role"] for m in msgs] == ["system", "user"]
            assert msgs[0]["content"] in prefixes and len(msgs[1]["content"].split()) == 10
        else:
            assert r.system is None


def test_dataset_option_errors() -> None:
    for opts, match in [
        (DatasetOptions(num_prompts=0), "num-prompts"),
        (DatasetOptions(range_ratio=1.0), "range-ratio"),
        (DatasetOptions(name="sharegpt"), "dataset-path"),
        (DatasetOptions(name="nope"), "--dataset must be"),
        (DatasetOptions(input_len=0), "at least 1"),
    ]:
        with pytest.raises(BenchError, match=match):
            load_dataset(opts, WordCounter())


# ---------------------------------------------------------------- ShareGPT
def _conv(human: str, reply: str) -> dict[str, Any]:
    return {"id": "x", "conversations": [{"from": "human", "value": human},
                                         {"from": "gpt", "value": reply}]}


def _words(n: int) -> str:
    return " ".join(["word"] * n)


def test_sharegpt_skips_and_counts_malformed_entries(tmp_path: Path) -> None:
    good = [_conv(_words(10 + i), _words(20 + i)) for i in range(5)]
    malformed = [
        "just a string",  # not_an_object
        {"id": "a"},  # no_conversations
        {"id": "b", "conversations": "hello"},  # no_conversations
        {"id": "c", "conversations": [{"from": "human"}]},  # malformed_turn (no value)
        {"id": "d", "conversations": [{"from": "human", "value": 3}]},  # malformed_turn
        {"id": "e", "conversations": [{"from": "gpt", "value": "hi"}]},  # no_human_turn
        {"id": "f", "conversations": [{"from": "human", "value": _words(9)}]},  # no_reply
        {"id": "g", "conversations": [{"from": "human", "value": "  "},
                                      {"from": "gpt", "value": "x"}]},  # no_human_turn
    ]
    too_short = [_conv("hi", _words(10)), _conv(_words(10), "ok")]
    too_long = [_conv(_words(1100), _words(10)), _conv(_words(1000), _words(1100))]
    # A system turn first and "user"/"assistant" names: the first human turn still counts.
    other_names = [{"conversations": [{"from": "system", "value": "be brief"},
                                      {"from": "user", "value": _words(12)},
                                      {"from": "assistant", "value": _words(6)}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(good + malformed + too_short + too_long + other_names))

    pairs, skipped = sharegpt_pairs(json.loads(path.read_text()))
    assert len(pairs) == 10
    assert skipped == {"not_an_object": 1, "no_conversations": 2, "malformed_turn": 2,
                       "no_human_turn": 2, "no_reply": 1}

    ds = load_dataset(DatasetOptions(name="sharegpt", path=str(path), num_prompts=100,
                                     seed=0), WordCounter())
    assert ds.skipped == dict(skipped)
    assert ds.filtered == {"too_short": 2, "too_long": 2}
    assert len(ds.requests) == 100  # 6 usable entries, repeated to reach N, and said so
    assert any("only 6 usable" in n for n in ds.notes)
    uniq = {(r.prompt_len, r.output_len) for r in ds.requests}
    assert uniq == {(10 + i, 20 + i) for i in range(5)} | {(12, 6)}

    fixed = load_dataset(DatasetOptions(name="sharegpt", path=str(path), num_prompts=3,
                                        output_len=9, seed=0), WordCounter())
    assert [r.output_len for r in fixed.requests] == [9, 9, 9]


def test_sharegpt_file_errors(tmp_path: Path) -> None:
    def load(text: str | None) -> None:
        p = tmp_path / "f.json"
        if text is not None:
            p.write_text(text)
        load_dataset(DatasetOptions(name="sharegpt", path=str(p), num_prompts=2),
                     WordCounter())

    with pytest.raises(BenchError, match="not found"):
        load(None)
    with pytest.raises(BenchError, match="not JSON"):
        load("[{")
    with pytest.raises(BenchError, match="JSON list"):
        load('{"conversations": []}')
    with pytest.raises(BenchError, match=r"no usable requests.*no_conversations"):
        load('[{"id": 1}, 5]')


# ---------------------------------------------------------------- JSONL
def test_jsonl_lines(tmp_path: Path) -> None:
    lines = [
        json.dumps({"prompt": "one two three", "max_tokens": 5}),
        "",
        "{not json",
        json.dumps(["a list"]),
        json.dumps({"prompt": "four five"}),  # default max_tokens
        json.dumps({"prompt": "x", "max_tokens": 0}),
        json.dumps({"prompt": "x", "max_tokens": "7"}),
        json.dumps({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"nothing": 1}),
    ]
    path = tmp_path / "reqs.jsonl"
    path.write_text("\n".join(lines) + "\n")

    chat = load_dataset(DatasetOptions(name="jsonl", path=str(path), num_prompts=3,
                                       endpoint="chat", output_len=11), WordCounter())
    assert [(r.prompt_len, r.output_len) for r in chat.requests] == [(3, 5), (2, 11), (2, 3)]
    assert chat.requests[2].chat_messages() == [{"role": "user", "content": "hi there"}]
    assert chat.requests[0].chat_messages() == [{"role": "user", "content": "one two three"}]
    assert chat.skipped == {"bad_json": 1, "not_an_object": 1, "bad_max_tokens": 2}

    comp = load_dataset(DatasetOptions(name="jsonl", path=str(path), num_prompts=5),
                        WordCounter())
    assert [r.prompt for r in comp.requests] == ["one two three", "four five"] * 2 + [
        "one two three"]
    assert comp.skipped == {"bad_json": 1, "not_an_object": 1, "bad_max_tokens": 2,
                            "messages_need_chat_endpoint": 1, "no_prompt_or_messages": 2}
    assert comp.requests[1].output_len == 128
    assert any("some repeat" in n for n in comp.notes)


def test_payloads() -> None:
    req = BenchRequest("a b", 2, 5, system="sys", user="b")
    comp = json.loads(build_payload(BenchRequest("a b", 2, 5), "completions", "m", True,
                                    {"top_k": 1}))
    assert comp == {"model": "m", "prompt": "a b", "max_tokens": 5, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "top_k": 1}
    chat = json.loads(build_payload(req, "chat", "m", False))
    assert chat["messages"] == [{"role": "system", "content": "sys"},
                                {"role": "user", "content": "b"}]
    assert chat["max_completion_tokens"] == 5 and "ignore_eos" not in chat


# ---------------------------------------------------------------- metrics
def _res(i: int, send: float, ttft: float | None, e2el: float | None, out: int | None,
         itl: list[float] | None = None, status: int | None = 200,
         error_type: str | None = None, prompt_len: int = 10) -> RequestResult:
    r = RequestResult(i, f"r{i}", prompt_len, 16, scheduled_s=send - 0.001, send_s=send,
                      ttft_s=ttft, e2el_s=e2el, output_tokens=out, itl_s=itl or [],
                      status=status, error_type=error_type)
    r.end_s = send + (e2el if e2el is not None else 0.05)
    return r


def hand_made() -> list[RequestResult]:
    return [
        # TPOT (1.1 - 0.05) / 10 = 0.105
        _res(0, 0.0, 0.05, 1.1, 11, [0.1] * 10, prompt_len=10),
        # TPOT (0.5 - 0.3) / 2 = 0.1 (E2EL counts the time after the last chunk too)
        _res(1, 0.5, 0.3, 0.5, 3, [0.05, 0.1], prompt_len=20),
        # one output token: no TPOT (0 for goodput)
        _res(2, 1.0, 0.2, 0.2, 1, prompt_len=30),
        _res(3, 1.2, None, None, None, status=429, error_type="rate_limit_exceeded",
             prompt_len=40),
        _res(4, 1.3, None, None, None, status=None, error_type="timeout", prompt_len=50),
    ]


def test_metric_arithmetic_known_answers() -> None:
    m = compute_metrics(hand_made(), duration_s=2.0, percentiles=[50, 99, 99.9])
    assert (m["completed"], m["failed"]) == (3, 2)
    assert m["total_input_tokens"] == 60  # successful requests only, as vLLM
    assert m["total_output_tokens"] == 15
    assert m["request_throughput"] == 1.5
    assert m["output_throughput"] == 7.5
    assert m["total_token_throughput"] == 37.5
    assert m["request_goodput"] is None
    # TTFTs 50, 300, 200 ms
    assert m["mean_ttft_ms"] == pytest.approx(550 / 3)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    std = math.sqrt(((50 - 550 / 3) ** 2 + (300 - 550 / 3) ** 2 + (200 - 550 / 3) ** 2) / 3)
    assert m["std_ttft_ms"] == pytest.approx(std)  # population std, as numpy and vLLM
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # linear: 200 + 0.98 * 100
    assert m["p99.9_ttft_ms"] == pytest.approx(299.8)
    assert m["p50_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(102.5) and m["std_tpot_ms"] == pytest.approx(2.5)
    # ITL pooled over requests: eleven 100 ms gaps and one of 50
    assert m["mean_itl_ms"] == pytest.approx(1150 / 12)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p99_itl_ms"] == pytest.approx(100.0)
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    assert m["median_e2el_ms"] == pytest.approx(500.0)
    # In flight: r0 [0, 1.1], r1 [0.5, 1.0], r2 [1.0, 1.2], r3 [1.2, 1.25], r4 [1.3, 1.35]:
    # r1 ends at 1.0 as r2 starts (ends first), so never more than 2.
    assert m["max_concurrent_requests"] == 2
    # Chunk arrivals: r0 at 0.05, 0.15 .. 0.95 (10) and 1.05; r1 at 0.8, 0.85, 0.95; r2 at
    # 1.2: whole second 0 has 13.
    assert m["max_output_tokens_per_s"] == 13


def test_goodput_against_slos() -> None:
    res = hand_made()
    assert compute_metrics(res, 2.0, [99], parse_goodput(["ttft:250"]))[
        "request_goodput"] == 1.0  # r0 (100 ms), r2 (200 ms); r1 is 300 ms
    assert compute_metrics(res, 2.0, [99], parse_goodput(["tpot:50"]))[
        "request_goodput"] == 0.5  # only r2 (one token: TPOT 0)
    assert compute_metrics(res, 2.0, [99], parse_goodput(["ttft:250", "e2el:1000"]))[
        "request_goodput"] == 0.5  # r0 takes 1.1 s
    for bad in (["ttft"], ["ttft:x"], ["ttft:0"], ["latency:5"]):
        with pytest.raises(BenchError, match="--goodput"):
            parse_goodput(bad)


def test_empty_distributions_and_percentile_names() -> None:
    m = compute_metrics([_res(0, 0.0, None, None, None, status=500, error_type="e")],
                        1.0, [99])
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p99_e2el_ms"] == 0.0
    assert [p_word(p) for p in (50, 99.0, 99.9)] == ["50", "99", "99.9"]
    assert parse_percentiles("50, 99,99.9") == [50.0, 99.0, 99.9]
    for bad in ("", "a", "0", "101"):
        with pytest.raises(BenchError, match="percentiles"):
            parse_percentiles(bad)


def test_client_summary_failures_and_lengths() -> None:
    s = client_summary(hand_made(), [50])
    assert s["failures"]["by_status"] == {"429": 1, "none": 1}
    assert s["failures"]["by_type"] == {"rate_limit_exceeded": 1, "timeout": 1}
    assert s["lengths"]["input"]["mean"] == 30.0
    assert (s["lengths"]["input_min"], s["lengths"]["input_max"]) == (10, 50)
    assert s["lengths"]["output_received"]["mean"] == 5.0
    assert s["send_lag_ms"]["max"] == pytest.approx(1.0)


def test_max_concurrency_counts_overlaps_exactly() -> None:
    rs = [_res(i, 0.1 * i, 0.01, 1.0, 2) for i in range(5)]  # all overlap at 0.4..1.0
    assert max_concurrency(rs) == 5
    assert max_concurrency([_res(i, float(i), 0.01, 0.5, 2) for i in range(5)]) == 1


def test_http_error_descriptions() -> None:
    body = json.dumps({"error": {"message": "too long", "type": "invalid_request_error"}})
    assert describe_http_error(400, body.encode(), "Bad Request") == (
        "invalid_request_error", "HTTP 400: too long")
    assert describe_http_error(422, b'{"detail": "nope"}', None) == ("http_422", "HTTP 422: nope")
    assert describe_http_error(502, b"<html>bad gateway</html>", "Bad Gateway") == (
        "http_502", "HTTP 502: <html>bad gateway</html>")
    assert describe_http_error(503, b"", "Service Unavailable") == (
        "http_503", "HTTP 503: Service Unavailable")


def test_metrics_line_filter() -> None:
    text = "\n".join([
        "# HELP tailserve:num_requests_running running",
        "# TYPE tailserve:num_requests_running gauge",
        "tailserve:num_requests_running 3.0",
        'tailserve:device_memory_used_bytes{device="cuda:0"} 1.5e+09',
        'tailserve:time_to_first_token_seconds_bucket{le="0.1"} 4.0',
        "process_resident_memory_bytes 1.2e+08",
        "vllm:num_requests_waiting 2",
        "other_metric 1",
    ])
    assert parse_metrics(text) == {
        "tailserve:num_requests_running": 3.0,
        'tailserve:device_memory_used_bytes{device="cuda:0"}': 1.5e9,
        "process_resident_memory_bytes": 1.2e8,
        "vllm:num_requests_waiting": 2.0,
    }
