"""The server with the default model, driven by the official ``openai`` client on loopback.

Answers are checked against the offline engine (``LLM``) on the same weights: what crosses the
process boundary and the HTTP edge must not change a single token.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from server_util import ServerProcess, metric_value
from tailserve.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def timeline_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("timeline") / "timeline.jsonl")


@pytest.fixture(scope="module")
def server(timeline_path: str) -> Iterator[ServerProcess]:
    # The GGUF dequantized, as the offline reference engine (default_llm) loads it: the
    # completions are compared token for token (packed-vs-float: tests/test_gguf_packed.py).
    with ServerProcess(
        ["--dtype", "float32", "--max-model-len", "2048", "--timeline", timeline_path,
         "--gguf-weights", "dequantize"]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def _greedy(llm: Any, prompt: str, max_tokens: int) -> str:
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
    return str(out.outputs[0].text)


def test_completion_matches_offline_engine(client: openai.OpenAI, default_llm: Any) -> None:
    for prompt in (PROMPT, "def fibonacci(n):"):
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24,
                                         temperature=0)
        assert resp.choices[0].text == _greedy(default_llm, prompt, 24)
        assert resp.choices[0].finish_reason == "length"
        n_prompt = len(default_llm.tokenizer(prompt).input_ids)
        assert resp.usage is not None
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n_prompt, 24)
        assert resp.usage.total_tokens == n_prompt + 24
        timing = (resp.model_extra or {})["tailserve_timing"]
        assert timing["output_tokens"] == 24 and timing["prompt_tokens"] == n_prompt
        assert 0 <= timing["queue_s"] <= timing["ttft_s"] <= timing["e2e_s"]
        assert timing["num_steps"] == 24


def test_streamed_completion_equals_unstreamed(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 20
    assert (last.model_extra or {})["tailserve_timing"]["output_tokens"] == 20


def test_chat_usage_and_stream(server: ServerProcess, client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Name a fruit."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          temperature=0)
    counted = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["count"]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == counted
    timing = (resp.model_extra or {})["tailserve_timing"]
    assert resp.usage.completion_tokens == timing["output_tokens"] >= 1
    assert resp.usage.total_tokens == counted + timing["output_tokens"]
    assert resp.choices[0].message.role == "assistant"

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == resp.choices[0].finish_reason
    # Without include_usage the timing rides on the last chunk.
    assert "tailserve_timing" in (chunks[-1].model_extra or {})


def test_stop_string_truncates_streamed_and_not(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                     temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 4, base
    stop = words[2]
    expected = base[: base.index(stop)]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     stop=[stop])
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
        ) if c.choices
    )
    assert streamed == expected


def test_seed_reproducible_and_n(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed
        ).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                     temperature=1.0, seed=5, n=2)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage is not None and resp.usage.completion_tokens == 16


def test_logprobs(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     logprobs=3)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert chosen is not None and chosen <= 0
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the top token

    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == chat.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)


def test_streamed_logprobs_offsets_continue_across_chunks(client: openai.OpenAI) -> None:
    """text_offset counts from the start of the completion in every chunk, as in the body;
    logprobs=0 names the sampled token in each entry (no empty dicts)."""
    for k in (0, 2):
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8,
                                         temperature=0, logprobs=k)
        chunks = list(client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=k, stream=True,
        ))
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        tokens: list[str] = []
        for c in chunks:
            lp = c.choices[0].logprobs if c.choices else None
            if lp is not None:
                offsets += lp.text_offset or []
                tops += lp.top_logprobs or []
                tokens += lp.tokens or []
        body = full.choices[0].logprobs
        assert body is not None and body.tokens is not None
        assert len(chunks) > 2  # more than one chunk carried tokens
        assert tokens == body.tokens
        assert offsets == body.text_offset
        expected, pos = [], 0
        for t in body.tokens:
            expected.append(pos)
            pos += len(t)
        assert offsets == expected
        assert tops == body.top_logprobs
        assert [len(t) for t in tops] == [max(k, 1)] * 8
        if k == 0:
            assert [list(t) for t in tops] == [[t] for t in body.tokens]
            assert [t[s] for t, s in zip(tops, body.tokens, strict=True)] == body.token_logprobs


def test_token_id_prompt_and_list_of_prompts(client: openai.OpenAI, server: ServerProcess) -> None:
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=4,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text[: len(both.choices[0].text)]


def test_models_version_tokenize_detokenize(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    # The served name, not where the weights are installed.
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["root"] == MODEL
    assert httpx.get(server.url + "/version").json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    text = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()
    assert text["prompt"].strip() == "Hello world"


def test_request_id_metrics_and_timeline(server: ServerProcess, timeline_path: str) -> None:
    t0 = time.time()
    r = httpx.post(server.url + "/v1/completions", headers={"x-request-id": "abc-123"},
                   json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-123"
    assert httpx.get(server.url + "/health").headers["x-request-id"]

    metrics = httpx.get(server.url + "/metrics").text
    assert (metric_value(metrics, "tailserve:request_success_total",
                         {"finished_reason": "length"}) or 0) >= 1
    assert (metric_value(metrics, "tailserve:time_to_first_token_seconds_count") or 0) >= 1
    assert (metric_value(metrics, "tailserve:engine_step_seconds_count") or 0) >= 3
    assert metric_value(metrics, "tailserve:num_requests_running") == 0
    total = metric_value(metrics, "tailserve:kv_cache_total_blocks")
    assert total and metric_value(metrics, "tailserve:kv_cache_free_blocks") == total
    # 135M float32 parameters, plus the kernels' panel copies.
    weights = metric_value(metrics, "tailserve:model_weight_bytes", {"format": "float32"})
    assert weights is not None and weights > 4 * 134e6

    recent = httpx.get(server.url + "/debug/timeline", params={"since": t0}).json()["records"]
    mine = [r for r in recent if r["kind"] == "request" and r["request_id"] == "abc-123"]
    assert len(mine) == 1
    assert mine[0]["output_tokens"] == 3 and mine[0]["timing"]["output_tokens"] == 3
    steps = [r for r in recent if r["kind"] == "step"]
    assert len(steps) >= 3 and all(s["t"] > t0 for s in steps)
    assert all({"step_s", "num_prefill_tokens", "num_decode_seqs", "free_blocks", "memory"}
               <= s.keys() for s in steps)
    with open(timeline_path) as f:
        lines = [json.loads(line) for line in f]
    assert any(r["kind"] == "request" and r["request_id"] == "abc-123" for r in lines)
    assert os.path.getsize(timeline_path) > 0


def test_cache_salt_isolates_the_prefix_cache(client: openai.OpenAI, server: ServerProcess) -> None:
    """vLLM's ``cache_salt``: a prompt cached under one salt is a hit for that salt only, not
    for another salt nor for unsalted requests; the first tenant still hits its own."""
    doc = " ".join(f"Shelf {i} holds {i * 7 % 13} jars of plum jam." for i in range(40))

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        resp = client.completions.create(model=MODEL, prompt=doc, max_tokens=1, temperature=0,
                                         extra_body=extra)
        assert resp.usage is not None and resp.usage.prompt_tokens > 300
        return int((resp.model_extra or {})["tailserve_timing"]["cached_prompt_tokens"])

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 300
    assert cached("tenant-b") == 0
    assert cached(None) == 0
    assert cached("tenant-b") > 300
    for bad, why in ((7, "string"), ("", "at least 1"), ("x" * 1025, "at most 1024")):
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": bad})
        assert r.status_code == 400, r.text
        assert why in r.text and "cache_salt" in r.text
