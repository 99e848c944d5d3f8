"""Every field of OpenAI's and vLLM's completions, chat and responses request bodies, and what
this server does with it: served, ignored (it cannot change the output), or refused with a 400
naming it.

A field the request models do not declare arrives in ``model_extra`` (``extra="allow"``);
``check_fields`` refuses the refused ones whenever their value is not a neutral one (``None``,
or the value that asks for the default behaviour, e.g. ``use_beam_search: false``), so a client
that asked for something is never answered with a 200 that silently dropped it. Fields that no
table lists (a newer SDK's) are ignored; docs/server.md lists the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel

from tailserve.server.errors import bad_request

Endpoint = Literal["completions", "chat", "responses"]
Support = Literal["served", "ignored", "refused"]
BOTH: tuple[Endpoint, ...] = ("completions", "chat")


@dataclass(frozen=True)
class RequestField:
    name: str
    endpoints: tuple[Endpoint, ...]
    support: Support
    why: str = ""
    # Values that ask for nothing (a refused field set to one of them passes).
    neutral: tuple[Any, ...] = (None,)


def _f(name: str, support: Support, why: str = "", endpoints: tuple[Endpoint, ...] = BOTH,
       neutral: tuple[Any, ...] = (None,)) -> RequestField:
    return RequestField(name, endpoints, support, why, neutral)


C: tuple[Endpoint, ...] = ("completions",)
CHAT: tuple[Endpoint, ...] = ("chat",)
R: tuple[Endpoint, ...] = ("responses",)

FIELDS: tuple[RequestField, ...] = (
    # ---- OpenAI, both endpoints
    _f("model", "served"),
    _f("n", "served"),
    _f("temperature", "served"),
    _f("top_p", "served"),
    _f("presence_penalty", "served"),
    _f("frequency_penalty", "served"),
    _f("seed", "served"),
    _f("stop", "served"),
    _f("stream", "served"),
    _f("stream_options", "served", "only with stream: true"),
    _f("max_tokens", "served"),
    _f("logprobs", "served"),
    _f("logit_bias", "refused", "per-token biases are not applied", neutral=(None, {})),
    _f("user", "ignored", "an end-user id for abuse monitoring"),
    _f("response_format", "served", "text, json_object, json_schema"),
    # ---- OpenAI, completions only
    _f("prompt", "served", endpoints=C),
    _f("best_of", "served", "must equal n", endpoints=C),
    _f("echo", "refused", "the prompt is not echoed", endpoints=BOTH, neutral=(None, False)),
    _f("suffix", "refused", "no fill-in-the-middle", endpoints=C, neutral=(None, "")),
    _f("max_completion_tokens", "served", "as max_tokens"),
    # ---- OpenAI, chat only
    _f("messages", "served", endpoints=CHAT),
    _f("top_logprobs", "served", endpoints=CHAT),
    _f("tools", "served", "function tools (server/tools.py)", endpoints=CHAT),
    _f("tool_choice", "served", "none, auto, required or a named function; needs tools",
       endpoints=CHAT),
    _f("parallel_tool_calls", "served", "false: at most one call", endpoints=CHAT),
    _f("functions", "refused", "the deprecated functions API is not served", endpoints=CHAT),
    _f("function_call", "refused", "the deprecated functions API is not served",
       endpoints=CHAT, neutral=(None, "none")),
    _f("audio", "refused", "no audio output", endpoints=CHAT),
    _f("modalities", "refused", "text is the only modality", endpoints=CHAT,
       neutral=(None, ["text"])),
    _f("prediction", "ignored", "a predicted output only speeds up its provider, never "
       "changes the answer", endpoints=CHAT),
    _f("reasoning_effort", "refused", "the model does not reason", endpoints=CHAT),
    _f("verbosity", "refused", "the model has no verbosity control", endpoints=CHAT),
    _f("web_search_options", "refused", "no web search", endpoints=CHAT),
    _f("metadata", "ignored", "stored-completion tags; nothing is stored", endpoints=CHAT),
    _f("store", "ignored", "nothing is stored, the answer is the same", endpoints=CHAT),
    _f("service_tier", "ignored", "one tier", endpoints=CHAT),
    _f("prompt_cache_key", "ignored", "a routing hint; the prefix cache needs none",
       endpoints=CHAT),
    _f("prompt_cache_retention", "ignored", "a retention hint", endpoints=CHAT),
    _f("prompt_cache_options", "ignored", "a retention hint", endpoints=CHAT),
    _f("safety_identifier", "ignored", "an end-user id for abuse monitoring", endpoints=CHAT),
    _f("moderation", "refused", "no moderation", endpoints=CHAT),
    # ---- vLLM's extensions, both endpoints
    _f("top_k", "served"),
    _f("min_p", "served"),
    _f("repetition_penalty", "served"),
    _f("stop_token_ids", "served"),
    _f("include_stop_str_in_output", "served"),
    _f("ignore_eos", "served"),
    _f("min_tokens", "served"),
    _f("skip_special_tokens", "served"),
    _f("priority", "served"),
    _f("cache_salt", "served"),
    _f("slo", "served", "tailserve's per-request SLO: ttft_ms, itl_ms, tpot_ms (docs/slo.md)"),
    _f("structured_outputs", "served", "json, regex, choice, grammar (Lark or GBNF), json_object"),
    _f("guided_json", "served", "vLLM's older spelling of structured_outputs.json"),
    _f("guided_regex", "served", "vLLM's older spelling of structured_outputs.regex"),
    _f("guided_choice", "served", "vLLM's older spelling of structured_outputs.choice"),
    _f("guided_grammar", "served", "vLLM's older spelling of structured_outputs.grammar"),
    _f("guided_decoding_backend", "ignored", "llguidance is the one backend"),
    _f("guided_whitespace_pattern", "refused", "JSON whitespace is the backend's"),
    _f("use_beam_search", "refused", "no beam search", neutral=(None, False)),
    _f("length_penalty", "refused", "only for beam search", neutral=(None, 1.0)),
    _f("spaces_between_special_tokens", "refused", "special tokens are detokenized as they "
       "are", neutral=(None, True)),
    _f("truncate_prompt_tokens", "refused", "prompts are never truncated"),
    _f("allowed_token_ids", "refused", "use structured_outputs.choice or a grammar"),
    _f("bad_words", "refused", "no banned words", neutral=(None, [])),
    _f("prompt_logprobs", "refused", "prompt logprobs are not computed"),
    _f("add_special_tokens", "refused", "the tokenizer's defaults are used"),
    _f("logits_processors", "refused", "no custom logits processors"),
    _f("return_tokens_as_token_ids", "refused", "tokens are returned as text",
       neutral=(None, False)),
    _f("return_token_ids", "refused", "token ids are not returned", neutral=(None, False)),
    _f("kv_transfer_params", "refused", "no disaggregated prefill"),
    _f("vllm_xargs", "refused", "no custom sampling extensions"),
    _f("request_id", "ignored", "the server names requests (x-request-id)"),
    _f("prompt_embeds", "refused", "prompts are text or token ids", endpoints=C),
    # ---- vLLM's chat extensions
    _f("add_generation_prompt", "served", endpoints=CHAT),
    _f("continue_final_message", "refused", "the last message is not continued",
       endpoints=CHAT, neutral=(None, False)),
    _f("documents", "refused", "no RAG documents in the template", endpoints=CHAT),
    _f("chat_template", "refused", "the model's own template is used", endpoints=CHAT),
    _f("chat_template_kwargs", "refused", "the template takes no extra arguments",
       endpoints=CHAT, neutral=(None, {})),
    _f("mm_processor_kwargs", "refused", "text only", endpoints=CHAT),
    _f("include_reasoning", "served", "false leaves reasoning_content out (with "
       "--reasoning-parser)", endpoints=CHAT),
    # ---- OpenAI's /v1/responses (server/responses.py): stateless, text and function tools
    *(_f(name, "served", endpoints=R) for name in (
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
        "tools", "tool_choice", "parallel_tool_calls", "stream")),
    _f("text", "served", "format: text, json_object, json_schema", endpoints=R),
    _f("stream_options", "ignored", "include_obfuscation: no padding is added to the events",
       endpoints=R),
    _f("metadata", "ignored", "echoed in the response; nothing is stored", endpoints=R),
    *(_f(name, "ignored", why, endpoints=R) for name, why in (
        ("user", "an end-user id for abuse monitoring"),
        ("safety_identifier", "an end-user id for abuse monitoring"),
        ("service_tier", "one tier"),
        ("prompt_cache_key", "a routing hint; the prefix cache needs none"),
        ("prompt_cache_retention", "a retention hint"),
        ("prompt_cache_options", "a retention hint"),
        ("max_tool_calls", "a limit on built-in tools; there are none"),
        ("request_id", "the server names requests (x-request-id)"))),
    _f("previous_response_id", "refused", "nothing is stored: send the whole conversation in "
       "input", endpoints=R),
    _f("store", "refused", "nothing is stored; send store: false", endpoints=R,
       neutral=(None, False)),
    _f("conversation", "refused", "nothing is stored: send the whole conversation in input",
       endpoints=R),
    _f("prompt", "refused", "no stored prompt templates", endpoints=R),
    _f("background", "refused", "no background responses", endpoints=R,
       neutral=(None, False)),
    _f("background_options", "refused", "no background responses", endpoints=R),
    _f("include", "refused", "no extra output data (logprobs, sources, encrypted reasoning)",
       endpoints=R, neutral=(None, [])),
    _f("top_logprobs", "refused", "logprobs are not returned here", endpoints=R,
       neutral=(None, 0)),
    _f("truncation", "refused", "the input is never truncated", endpoints=R,
       neutral=(None, "disabled")),
    _f("reasoning", "refused", "the model does not reason", endpoints=R, neutral=(None, {})),
    _f("context_management", "refused", "no context compaction", endpoints=R),
    _f("moderation", "refused", "no moderation", endpoints=R),
    _f("access_programs", "refused", "no access programs", endpoints=R),
    _f("image", "refused", "text only", endpoints=R),
    # vLLM's sampling extensions and tailserve's own, served as on chat
    *(_f(name, "served", "as on chat", endpoints=R) for name in (
        "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "priority",
        "cache_salt", "slo")),
)

BY_ENDPOINT: dict[Endpoint, dict[str, RequestField]] = {
    e: {f.name: f for f in FIELDS if e in f.endpoints} for e in (*BOTH, "responses")
}


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(value is None if n is None else value == n for n in neutral)


def check_fields(body: BaseModel, endpoint: Endpoint) -> None:
    """Raise a 400 naming the first refused field ``body`` sets to a non-neutral value."""
    table = BY_ENDPOINT[endpoint]
    given = dict(body.model_extra or {})
    for k in body.model_fields_set:
        value = getattr(body, k)
        given[k] = value.model_dump(exclude_none=True) if isinstance(value, BaseModel) else value
    for name, value in given.items():
        field = table.get(name)
        if field is None or field.support != "refused" or _is_neutral(value, field.neutral):
            continue
        raise bad_request(f"{name} is not supported: {field.why}", param=name)
