"""No silent drops: every field of OpenAI's and vLLM's completions and chat request bodies is
served, ignored because it cannot change the output, or refused with a 400 that names it
(``server/request_fields.py``). The table is checked against the installed ``openai`` SDK's own
parameter lists and vLLM's, then walked on a live server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from server_util import ServerProcess
from tailserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tailserve.server.request_fields import BY_ENDPOINT, FIELDS

# vLLM's request extensions (its protocol.py's CompletionRequest / ChatCompletionRequest), by
# endpoint: the SDK does not know them.
VLLM_BOTH = {
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "priority", "cache_salt",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "use_beam_search",
    "length_penalty", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "bad_words", "prompt_logprobs", "add_special_tokens",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids",
    "kv_transfer_params", "vllm_xargs", "request_id", "response_format", "echo",
}
VLLM_COMPLETIONS = VLLM_BOTH | {"prompt_embeds", "max_completion_tokens"}
VLLM_CHAT = VLLM_BOTH | {
    "add_generation_prompt", "continue_final_message", "documents", "chat_template",
    "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning",
}
# In the SDK's Streaming/NonStreaming subclasses, not the base TypedDict.
SDK_STREAM = {"stream"}

# A value asking for something, for each field the walk sends.
SAMPLES: dict[str, Any] = {
    "logit_bias": {"50": 1.0}, "echo": True, "suffix": "end", "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high", "verbosity": "low", "web_search_options": {},
    "metadata": {"k": "v"}, "store": True, "service_tier": "auto", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {}, "safety_identifier": "u",
    "moderation": {}, "user": "u", "parallel_tool_calls": True,
    "guided_decoding_backend": "xgrammar", "guided_whitespace_pattern": " ",
    "use_beam_search": True, "length_penalty": 0.5, "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 4, "allowed_token_ids": [1, 2], "bad_words": ["x"],
    "prompt_logprobs": 1, "add_special_tokens": False, "logits_processors": ["x"],
    "return_tokens_as_token_ids": True, "return_token_ids": True,
    "kv_transfer_params": {}, "vllm_xargs": {"a": 1}, "request_id": "mine",
    "prompt_embeds": "AAAA", "continue_final_message": True, "documents": [{"t": "x"}],
    "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1},
    "mm_processor_kwargs": {}, "include_reasoning": False, "tools": [{"type": "function"}],
}


def test_every_sdk_and_vllm_field_is_in_the_table() -> None:
    sdk = {
        "completions": set(completion_create_params.CompletionCreateParamsBase.__annotations__),
        "chat": set(chat_create_params.CompletionCreateParamsBase.__annotations__),
    }
    expected = {"completions": sdk["completions"] | SDK_STREAM | VLLM_COMPLETIONS,
                "chat": sdk["chat"] | SDK_STREAM | VLLM_CHAT}
    for endpoint, names in expected.items():
        missing = names - set(BY_ENDPOINT[endpoint])  # type: ignore[index]
        assert not missing, f"{endpoint}: {sorted(missing)} are in no table"


def test_every_declared_field_is_in_the_table() -> None:
    for model, endpoint in ((CompletionRequest, "completions"), (ChatCompletionRequest, "chat")):
        declared = {f.alias or name for name, f in model.model_fields.items()}
        assert declared - set(BY_ENDPOINT[endpoint]) == set(), endpoint  # type: ignore[index]


def test_table_names_are_unique_per_endpoint() -> None:
    seen: set[tuple[str, str]] = set()
    for f in FIELDS:
        for e in f.endpoints:
            assert (f.name, e) not in seen, f.name
            seen.add((f.name, e))
        assert f.support == "served" or f.why, f"{f.name}: say why it is {f.support}"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(["--max-model-len", "512"]) as srv:
        yield srv


def _post(server: ServerProcess, endpoint: str, extra: dict[str, Any]) -> httpx.Response:
    if endpoint == "chat":
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "Hi"}]}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": "Hi"}
        path = "/v1/completions"
    body.update({"max_tokens": 1, "temperature": 0})
    body.update(extra)
    return httpx.post(server.url + path, json=body, timeout=60)


@pytest.mark.slow
def test_walk_refused_and_ignored_fields(server: ServerProcess) -> None:
    for endpoint in ("completions", "chat"):
        for name, field in BY_ENDPOINT[endpoint].items():  # type: ignore[index]
            if field.support == "served":
                continue
            r = _post(server, endpoint, {name: SAMPLES.get(name, "x")})
            if field.support == "ignored":
                assert r.status_code == 200, (endpoint, name, r.text)
            else:
                assert r.status_code == 400, (endpoint, name, r.text)
                assert r.json()["error"]["param"] == name, (endpoint, name, r.text)
            if field.support == "refused" and field.neutral != (None,):
                # The neutral values ask for nothing and pass.
                for value in field.neutral[1:]:
                    r = _post(server, endpoint, {name: value})
                    assert r.status_code == 200, (endpoint, name, value, r.text)


@pytest.mark.slow
def test_pairings_openai_and_vllm_refuse(server: ServerProcess) -> None:
    r = _post(server, "chat", {"stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = _post(server, "completions", {"stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = _post(server, "chat", {"tool_choice": "none"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = _post(server, "completions", {"max_tokens": 2, "max_completion_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


@pytest.mark.slow
def test_max_completion_tokens_on_completions(server: ServerProcess) -> None:
    body = {"prompt": "Count: one, two,", "max_completion_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


def test_docs_list_every_ignored_and_refused_field() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "server.md").read_text()
    section = text.split("## Request fields", 1)[1].split("\n## ", 1)[0]
    for f in FIELDS:
        if f.support != "served":
            assert f"`{f.name}" in section, f"docs/server.md does not list {f.name}"
