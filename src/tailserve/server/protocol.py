"""OpenAI request schemas (pydantic). Responses are built as plain dicts in ``serving.py``.

Field names and defaults follow OpenAI's API; the sampling extras vLLM users send (top_k,
min_p, repetition_penalty, ignore_eos, ...) are accepted too. Ranges are checked once, by
``SamplingParams`` and the length check, so every message carries the numbers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Integers cross to the engine as msgpack int64: a larger one (e.g. a seed of 2**64) must be a
# 400 naming its field here, not an OverflowError (500) when the request is sent.
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class _Base(BaseModel):
    # Unknown fields are ignored, as OpenAI's SDKs add new ones over time.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Base):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    # OpenAI's response_format.json_schema; unknown keys are a 400 naming response_format.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema (server/structured.py)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    strict: bool | None = None  # accepted beside json_schema too, as some clients send it


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of json, regex, choice, grammar, json_object."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None  # one backend: nothing to fall back from
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None


class _SamplingFields(_Base):
    # Fields no model here declares land in model_extra, where request_fields.check_fields
    # finds the ones OpenAI or vLLM define and this server refuses (never a silent drop).
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    n: Int64 = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: Int64 = 0
    # vLLM's prefix-cache isolation: cached KV blocks are shared only among requests with the
    # same salt (kv.block_pool.hash_block mixes it into the chain's root).
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    # The request's own SLO (server/slo.py): {"ttft_ms": ..., "itl_ms": ..., "tpot_ms": ...}.
    slo: Any = None
    # Structured output (server/structured.py turns these into one grammar).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


PromptInput = Annotated[
    str | list[str] | list[int] | list[list[int]],
    Field(description="text, a list of texts, token ids, or a list of token-id lists"),
]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    max_tokens: Int64 | None = 16
    max_completion_tokens: Int64 | None = None  # chat's name for max_tokens, served here too
    logprobs: Int64 | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int64 | None = None
    logit_bias: dict[str, float] | None = None


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant's calls ({"id", "type": "function", "function": {"name", "arguments"}})
    # and a tool message's answer to one; checked in server/tools.py.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    logit_bias: dict[str, float] | None = None
    # Tool calling (server/tools.py): function tools, "none" | "auto" | "required" |
    # {"type": "function", "function": {"name": ...}}, and whether several calls may come.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: with --reasoning-parser, false leaves reasoning_content out.
    include_reasoning: bool = True


class TokenizeRequest(_Base):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]
