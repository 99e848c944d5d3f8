"""InputProcessor: prompts or chat messages plus ``SamplingParams`` -> validated engine requests.

The offline ``LLM`` and the server both shape their requests here, so a prompt is tokenized,
templated, checked and fanned out to ``n`` engine requests the same way on either path::

    text | {"prompt_token_ids": [...]}  ── prompt() ──┐
    chat messages ── chat template ───── chat() ─────┴─▶ Prompt(text, token_ids)
    Prompt + SamplingParams ── fan_out() ──▶ ParentRequest(request_id, prompt, children)

Before tokenizing, a text longer (in UTF-8 bytes) than ``max_text_bytes`` is refused: no token
covers more bytes than the vocabulary's longest one, so such a text is more than max_model_len
tokens and could never fit, and tokenizing it (seconds for a megabyte) would be wasted work.

``prompt`` / ``chat`` check the token ids against the vocabulary; ``fan_out`` checks the lengths
against max_model_len and the KV pool and makes the ``n`` children. A caller validates all of
its prompts before it submits the first one, so a bad prompt leaves nothing queued. The engine
runs the same checks again (``request.py``): it stays the authority.

Torch-free: the tokenizer is a Hugging Face fast tokenizer, used as an object.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tailserve.errors import InvalidRequestError, check_valid_unicode
from tailserve.request import (
    RequestLimits,
    check_prompt_token_ids,
    check_request_lengths,
    check_stop_token_ids,
)
from tailserve.sampling_params import SamplingParams

# vLLM's prompt forms: a text, or {"prompt_token_ids": [...]} (with an optional "prompt" text).
PromptType = str | Mapping[str, Any]
# OpenAI's form: content is a string, a list of text parts ({"type": "text", "text": ...}),
# or absent.
Message = Mapping[str, Any]


@dataclass(frozen=True)
class Prompt:
    """One prompt as the engine sees it: its token ids, and the text they came from (None
    when the caller gave token ids only)."""

    text: str | None
    token_ids: list[int]


@dataclass(frozen=True)
class ParentRequest:
    """What the caller asked for one prompt (one ``RequestOutput``, one group of OpenAI
    choices) and the engine requests that serve it: ``children`` maps each child request id
    to its params, in completion order (child ``i`` is completion ``i``)."""

    request_id: str
    prompt: Prompt
    children: dict[str, SamplingParams]


class InputProcessor:
    """Built once per engine from its tokenizer and the limits it resolved at start-up."""

    def __init__(self, tokenizer: Any, limits: RequestLimits) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        token_bytes = max_token_bytes(tokenizer)
        # None: the tokenizer cannot list its vocabulary, so no bound is safe to assume.
        self.max_text_bytes = (
            None if token_bytes is None else limits.max_model_len * token_bytes
        )

    # ---------------------------------------------------------------- prompts
    def prompt(self, prompt: PromptType, what: str = "prompt") -> Prompt:
        """A text (tokenized with the tokenizer's special tokens, e.g. BOS) or token ids.
        ``what`` names the prompt in error messages (``prompt[2]`` of a list)."""
        if isinstance(prompt, str):
            return Prompt(prompt, self.tokenize(prompt, what=what, param="prompt"))
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            check_prompt_token_ids(ids, self.limits.vocab_size)
            return Prompt(prompt.get("prompt"), ids)
        raise InvalidRequestError(
            f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt)}",
            param="prompt",
        )

    @functools.cached_property
    def template_reads_tools(self) -> bool:
        """Whether the chat template renders ``tools`` (one of its variables)."""
        return "tools" in template_variables(getattr(self.tokenizer, "chat_template", None))

    def chat(
        self, messages: Sequence[Message], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prompt:
        """One conversation through the model's chat template; the template writes the special
        tokens itself, so the text is tokenized without adding any. ``tools`` (OpenAI's
        function tools) go to a template that reads them (``template_reads_tools``)."""
        self.check_text_bytes(
            sum(_utf8_len(t) for m in messages for t in _message_texts(m)), "messages",
            "messages",
        )
        for i, message in enumerate(messages):
            role = message.get("role")
            if isinstance(role, str):  # the server allows five roles; LLM.chat any text
                check_valid_unicode(role, f"messages[{i}].role", "messages")
            content = message.get("content")
            if isinstance(content, str):
                check_valid_unicode(content, f"messages[{i}].content", "messages")
            elif isinstance(content, list):
                for j, part in enumerate(content):
                    text = part.get("text")
                    if isinstance(text, str):
                        check_valid_unicode(
                            text, f"messages[{i}].content[{j}].text", "messages"
                        )
        try:
            text = self.tokenizer.apply_chat_template(
                [_template_message(m) for m in messages], tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools is not None else {}),
            )
        except Exception as exc:  # the template raises for conversations it does not accept
            raise InvalidRequestError(
                f"the chat template rejected these messages: {str(exc)[:200]}", param="messages"
            ) from None
        return Prompt(
            text, self.tokenize(text, add_special_tokens=False, what="messages", param="messages")
        )

    def tokenize(
        self, text: str, add_special_tokens: bool = True, *, what: str = "prompt",
        param: str = "prompt",
    ) -> list[int]:
        """``what`` names the text in an error message, ``param`` the request field it is."""
        self.check_text_bytes(_utf8_len(text), what, param)
        # The fast tokenizer raises TypeError on a lone surrogate: a 400 naming the field.
        check_valid_unicode(text, what, param)
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def check_text_bytes(self, num_bytes: int, what: str, param: str) -> None:
        """Refuse ``num_bytes`` of text that must be more than max_model_len tokens."""
        bound = self.max_text_bytes
        if bound is not None and num_bytes > bound:
            raise InvalidRequestError(
                f"{what} is {num_bytes} bytes of text, more than {bound} (max_model_len "
                f"{self.limits.max_model_len} x {bound // self.limits.max_model_len} bytes, "
                "the longest token): it cannot fit in max_model_len tokens",
                param=param,
            )

    # ---------------------------------------------------------------- requests
    def fan_out(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        *,
        always_suffix: bool = False,
    ) -> ParentRequest:
        """Check that ``prompt`` with ``params`` can be served, then make its ``n`` children:
        child ``i`` is ``{request_id}-{i}`` with ``n=1`` and ``seed + i`` (seeded completions
        differ from each other and still reproduce). A single child keeps ``request_id``
        itself unless ``always_suffix`` (the server's ids always carry the index).

        ``params`` is never changed; with ``n == 1`` the child shares it (it is frozen), or a
        copy with ``max_tokens=None`` resolved.
        """
        check_stop_token_ids(params.stop_token_ids, self.limits.vocab_size)
        max_tokens = check_request_lengths(
            self.limits, len(prompt.token_ids), params.max_tokens, params.n
        )
        if params.max_tokens is None:
            # The engine sees one child at a time and would resolve None to its own room;
            # the children carry the budget resolved for all n of them under the cap.
            params = dataclasses.replace(params, max_tokens=max_tokens)
        n = params.n
        if n == 1 and not always_suffix:
            return ParentRequest(request_id, prompt, {request_id: params})
        children: dict[str, SamplingParams] = {}
        for i in range(n):
            child = params
            if n > 1:
                seed = params.seed + i if params.seed is not None else None
                child = dataclasses.replace(params, n=1, seed=seed)
            children[f"{request_id}-{i}"] = child
        return ParentRequest(request_id, prompt, children)


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token can stand for: the longest token
    decoded on its own (special and added tokens included, e.g. ``<|im_start|>``), plus one
    byte for the leading space a SentencePiece-style decoder strips from a lone token.
    Exact for byte-level BPE (GPT-2, Llama 3, SmolLM2: 81 + 1 bytes); it assumes no normalizer
    shrinks text, which holds for the byte-level tokenizers tailserve loads. About 0.2 s for
    a 49k vocabulary, once at start-up. None for a tokenizer that cannot list its vocabulary.
    """
    try:
        size = len(tokenizer)
        texts = tokenizer.batch_decode(
            [[i] for i in range(size)], skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )
    except (AttributeError, TypeError, NotImplementedError):
        return None
    return max((_utf8_len(t) for t in texts), default=0) + 1


def _utf8_len(text: str) -> int:
    # Characters are at most bytes, so a short text skips the encode; surrogatepass so a
    # lone surrogate (refused later, naming its field) does not raise here.
    return len(text.encode("utf-8", "surrogatepass"))


def _message_texts(message: Message) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        return [t for part in content if isinstance(t := part.get("text"), str)]
    return []


# What a message may carry for templates that render tool calls and their results.
TOOL_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "name")


def _template_message(message: Message) -> dict[str, Any]:
    """A message as chat templates take it: text parts joined, no content as "", and the
    tool fields when it has them."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(str(part.get("text", "")) for part in content)
    out: dict[str, Any] = {"role": str(message.get("role")), "content": content or ""}
    for key in TOOL_MESSAGE_KEYS:
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def template_variables(template: Any) -> set[str]:
    """The variables a Jinja chat template reads (empty for no template, or one that does
    not parse: apply_chat_template reports that)."""
    if not isinstance(template, str):
        return set()
    import jinja2
    from jinja2 import meta

    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
        return set(meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError:
        return set()
