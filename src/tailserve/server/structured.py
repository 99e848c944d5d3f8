"""Structured output at the edge: a request body's grammar fields -> one
``StructuredOutputsParams``, checked and timed before the engine sees it.

The fields: OpenAI's ``response_format`` (``json_object``; ``json_schema`` with its ``schema``),
vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar`` as Lark or GBNF,
``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. At most one may be given.

``GrammarChecker`` builds the grammar's matcher and its first mask in a worker thread, under
``--grammar-timeout-ms``: over it, the request is a 400 with the figure; a grammar that does
not compile is a 400 with llguidance's reason. Verdicts are cached per grammar, so a schema
seen before costs nothing here (a slow one is refused at once). The event loop never waits on
a compile, and neither does the engine: a request reaches it only with a grammar that compiled
within the limit (the engine builds its own matcher off its step loop too).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tailserve.engine.structured_output import (
    build_matcher,
    check_syntax,
    fill_bitmask,
    grammar_of,
    lltokenizer_from_hf,
)
from tailserve.errors import InvalidRequestError
from tailserve.sampling_params import StructuredOutputsParams
from tailserve.server.errors import bad_request
from tailserve.server.protocol import _SamplingFields

logger = logging.getLogger(__name__)

# Grammars whose verdict is remembered (the text of each, a few KB for a large schema).
CACHE_SIZE = 512


def structured_outputs_of(body: _SamplingFields) -> tuple[StructuredOutputsParams, str] | None:
    """The body's grammar and the field it came from (errors name it), or None."""
    sources: list[tuple[str, Callable[[], StructuredOutputsParams]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        sources.append(("response_format", lambda: StructuredOutputsParams(json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        inner = rf.json_schema.json_schema if rf.json_schema is not None else None
        if inner is None:
            raise bad_request("response_format json_schema needs json_schema.schema",
                              param="response_format")
        sources.append(("response_format",
                        lambda: StructuredOutputsParams(json=_schema_text(inner))))
    so = body.structured_outputs
    if so is not None:
        sources.append(("structured_outputs", lambda: StructuredOutputsParams(
            json=None if so.json_ is None else _schema_text(so.json_), regex=so.regex,
            choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object))))
    guided_json, guided_choice = body.guided_json, body.guided_choice
    if guided_json is not None:
        sources.append(("guided_json",
                        lambda: StructuredOutputsParams(json=_schema_text(guided_json))))
    if body.guided_regex is not None:
        regex = body.guided_regex
        sources.append(("guided_regex", lambda: StructuredOutputsParams(regex=regex)))
    if guided_choice is not None:
        sources.append(("guided_choice", lambda: StructuredOutputsParams(choice=guided_choice)))
    if body.guided_grammar is not None:
        grammar = body.guided_grammar
        sources.append(("guided_grammar", lambda: StructuredOutputsParams(grammar=grammar)))
    if not sources:
        return None
    if len(sources) > 1:
        names = ", ".join(p for p, _ in sources)
        raise bad_request(f"give one way to constrain the output, got {names}",
                          param=sources[1][0])
    param, make = sources[0]
    try:
        return make(), param
    except InvalidRequestError as exc:
        raise bad_request(exc.message, param) from None


def _schema_text(schema: dict[str, Any] | str) -> str:
    """A schema as the text the engine and the cache key on (keys sorted: one entry per
    schema however a client orders it)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not JSON: {exc}",
                                      param="structured_outputs") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError("a JSON schema must be an object", param="structured_outputs")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


class GrammarChecker:
    """Compile + first mask of each new grammar in one worker thread, bounded by
    ``timeout_s``; verdicts cached per grammar text. ``on_compiled`` is told each compile's
    seconds (in the worker thread), including one that went past the limit, when it ends."""

    def __init__(self, hf_tokenizer: Any, timeout_s: float,
                 on_compiled: Callable[[float], None] | None = None,
                 lltokenizer: Any = None) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.timeout_s = timeout_s
        self._on_compiled = on_compiled
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-check")
        # llguidance's tokenizer: the server builds it at start-up (``lltokenizer``, from
        # ``load_tokenizers``); otherwise it is built at the first grammar.
        self._tokenizer: Future[Any] | None = None
        if lltokenizer is not None:
            self._tokenizer = Future()
            self._tokenizer.set_result(lltokenizer)
        self._lock = threading.Lock()
        # grammar text -> None (compiles within the limit) or the 400's message.
        self._verdicts: OrderedDict[str, str | None] = OrderedDict()
        self._in_flight: dict[str, Future[float]] = {}

    def _lltokenizer(self) -> Future[Any]:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = self._pool.submit(lltokenizer_from_hf, self._hf_tokenizer)
            return self._tokenizer

    async def check(self, so: StructuredOutputsParams, param: str) -> float:
        """Raise a 400 naming ``param`` unless the grammar compiles within the limit; return
        the seconds its compile and first mask took here (0 for a cached verdict)."""
        grammar = _key(so)
        with self._lock:
            known = grammar in self._verdicts
            verdict = self._verdicts.get(grammar)
            if known:
                self._verdicts.move_to_end(grammar)
        if known:
            if verdict is not None:
                raise bad_request(verdict, param)
            return 0.0
        # The tokenizer is built once (~2 s); its time is not the grammar's.
        tokenizer = await asyncio.wrap_future(self._lltokenizer())
        with self._lock:
            fut = self._in_flight.get(grammar)
            if fut is None:
                fut = self._pool.submit(_compile_and_first_mask, tokenizer, so)
                self._in_flight[grammar] = fut
        fut.add_done_callback(functools.partial(self._settle, grammar))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)),
                                          self.timeout_s)
        except asyncio.TimeoutError:
            # The compile runs on in the worker (llguidance's fuel limits end it); its verdict
            # is cached as slow, so the next request with this grammar is refused at once.
            raise bad_request(self._slow_message(), param) from None
        except InvalidRequestError as exc:
            raise bad_request(exc.message, param) from None
        except Exception as exc:  # llguidance refusing input in a way of its own: still a 400
            raise bad_request(f"the grammar could not be compiled ({type(exc).__name__}: "
                              f"{str(exc)[:300]})", param) from None

    def _slow_message(self, took_s: float | None = None) -> str:
        took = f" (took {took_s * 1e3:.0f} ms)" if took_s is not None else ""
        return (f"compiling the grammar exceeded --grammar-timeout-ms "
                f"({self.timeout_s * 1e3:.0f} ms){took}")

    def _settle(self, grammar: str, fut: Future[float]) -> None:
        """Record a finished compile's verdict (called in the worker thread)."""
        exc = fut.exception()
        verdict: str | None
        if isinstance(exc, InvalidRequestError):
            verdict = exc.message
        elif exc is not None:
            verdict = f"the grammar could not be compiled ({type(exc).__name__})"
        else:
            took = fut.result()
            verdict = self._slow_message(took) if took > self.timeout_s else None
            if self._on_compiled is not None:
                self._on_compiled(took)
        with self._lock:
            self._in_flight.pop(grammar, None)
            self._verdicts[grammar] = verdict
            while len(self._verdicts) > CACHE_SIZE:
                self._verdicts.popitem(last=False)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def load_tokenizers(model: str | None) -> tuple[Any, Any]:
    """The model's Hugging Face tokenizer and llguidance's, built from it: the server builds
    both at start-up (beside the engine's), so no request waits for them."""
    from tailserve.model.loader import load_tokenizer

    hf_tokenizer = load_tokenizer(model)
    try:
        lltokenizer = lltokenizer_from_hf(hf_tokenizer)
    except Exception as exc:  # a vocabulary llguidance cannot read: serve all the rest
        logger.warning("structured output: llguidance's tokenizer could not be built (%s: %s)",
                       type(exc).__name__, str(exc)[:300])
        lltokenizer = None
    return hf_tokenizer, lltokenizer


def _key(so: StructuredOutputsParams) -> str:
    """The cache key: the grammar as the request gave it (converting it is work too)."""
    return json.dumps([so.json, so.regex, so.choice, so.grammar, so.json_object])


def _compile_and_first_mask(tokenizer: Any, so: StructuredOutputsParams) -> float:
    """Convert, check, build the matcher and compute its first mask; the seconds it took."""
    t0 = time.perf_counter()
    grammar = grammar_of(so)
    check_syntax(grammar)
    matcher = build_matcher(tokenizer, grammar)
    mask = np.empty(-(-tokenizer.vocab_size // 32), dtype=np.int32)
    fill_bitmask(matcher, mask)
    if matcher.is_error():  # a limit hit while computing the first mask
        raise InvalidRequestError(f"invalid grammar: {matcher.get_error()[:500]}",
                                  param="structured_outputs")
    return time.perf_counter() - t0
