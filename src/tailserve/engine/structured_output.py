"""Structured output: a request's grammar as an llguidance matcher, one per request, in the engine.

Why llguidance: it has no compile step (the lexer is built lazily while masks are computed,
under fuel limits that bound every step), and it installs as one wheel with no dependency.
Measured on the bundled 49,152-token vocabulary (benchmarks/notes/structured_output.md):
a new 30-property schema's matcher in 1.3-14 ms and its first mask in 0.14-12 ms, then
~10 us a mask at the median.

The grammar's life, per engine request::

    add()          the grammar is converted, checked and its matcher built in a worker
                   thread (llguidance drops the GIL), so the step loop never waits on it;
                   the core holds the request back from the scheduler until ``ready()``.
    bitmasks()     before the forward: the packed allowed-token mask of each constrained row
                   that samples this step (int32 words, bit t of word t // 32 = token t).
    accept()       after the step: the sampled token advances the matcher; True once it can
                   take nothing more, which ends the request (``FINISHED_STOPPED``).
    free()         at finish or abort.

Preemption keeps a request's output tokens and recomputes them, so its matcher, which has
consumed exactly those tokens, stays as it is. Torch-free; llguidance is imported lazily.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tailserve.errors import InvalidRequestError
from tailserve.sampling_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

PARAM = "structured_outputs"
# JSON without free whitespace: a small model given room for it can emit newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(so: StructuredOutputsParams) -> str:
    """The llguidance grammar (its JSON form) for ``so``; raises ``InvalidRequestError``
    (param ``structured_outputs``) where the input cannot be read at all. Whether the grammar
    compiles is checked with a tokenizer (``check_grammar``)."""
    import llguidance

    m = llguidance.LLMatcher
    if so.json is not None or so.json_object:
        schema = so.json if so.json is not None else '{"type": "object"}'
        try:
            if not isinstance(json.loads(schema), dict):
                raise InvalidRequestError("a JSON schema must be an object", param=PARAM)
            return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as exc:  # json.JSONDecodeError is one
            if isinstance(exc, InvalidRequestError):
                raise
            raise InvalidRequestError(f"invalid JSON schema: {exc}", param=PARAM) from None
    if so.regex is not None:
        return m.grammar_from_regex(so.regex)
    if so.choice is not None:
        # A Lark alternation of string literals (JSON string syntax, which Lark's reads).
        return m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    assert so.grammar is not None
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(so.grammar)  # GBNF (llama.cpp's) is converted; Lark is kept
    except Exception as exc:  # the converter's own parse errors
        raise InvalidRequestError(f"the grammar does not parse: {exc}", param=PARAM) from None
    return m.grammar_from_lark(lark)


def check_syntax(grammar: str) -> None:
    """Raise ``InvalidRequestError`` when the grammar itself does not parse (no tokenizer)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(f"invalid grammar: {_short(error)}", param=PARAM)


def build_matcher(tokenizer: Any, grammar: str) -> Any:
    """An ``LLMatcher`` for ``grammar``; raises ``InvalidRequestError`` with llguidance's
    reason (an unsupported schema keyword, a regex that does not parse, a limit hit)."""
    import llguidance

    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequestError(f"invalid grammar: {_short(matcher.get_error())}",
                                  param=PARAM)
    return matcher


def fill_bitmask(matcher: Any, row: np.ndarray) -> None:
    """Write ``matcher``'s next allowed-token mask into ``row`` (int32, C-contiguous)."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)


def _short(message: str) -> str:
    return message.strip().splitlines()[0][:500] if message.strip() else "unknown error"


def lltokenizer_from_hf(hf_tokenizer: Any) -> Any:
    """llguidance's view of a fast Hugging Face tokenizer: 0.3-1 s for the bundled 49k
    vocabulary on this 2-core host (more under load), once per process."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer)


class StructuredOutputManager:
    """The engine's matchers, by request id. ``load_tokenizer`` returns the model's Hugging Face
    tokenizer. llguidance's own tokenizer is built from it once: at start-up when the engine
    serves (``build_tokenizer``, or ``tokenizer`` handed in built), else in the worker thread
    at the first constrained request (the offline ``LLM``, whose start should not pay for a
    feature it may never use)."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 tokenizer: Any = None) -> None:
        self._load_tokenizer = load_tokenizer
        self._tokenizer: Any = tokenizer
        self._words = -(-vocab_size // 32)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._building: dict[str, Future[Any]] = {}
        self._matchers: dict[str, Any] = {}
        # Seconds of grammar work per request (matcher build + masks): tailserve_timing.
        self.grammar_s: dict[str, float] = {}

    @property
    def tokenizer(self) -> Any:
        """llguidance's tokenizer, or None while it is not built."""
        return self._tokenizer

    def build_tokenizer(self) -> float:
        """Build llguidance's tokenizer now unless it is built; the seconds that took (0 when
        it was there). A request that found it missing would wait that long in the queue
        (benchmarks/notes/structured_output.md: 6 s on a loaded host)."""
        with self._lock:
            if self._tokenizer is not None:
                return 0.0
            t0 = time.perf_counter()
            self._tokenizer = lltokenizer_from_hf(self._load_tokenizer())
            took = time.perf_counter() - t0
        logger.info("structured output: tokenizer ready in %.2f s", took)
        return took

    def __len__(self) -> int:
        return len(self._building) + len(self._matchers)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers or request_id in self._building

    def add(self, request_id: str, so: StructuredOutputsParams) -> None:
        """Convert, check and build in the worker: a large schema's conversion is work too.
        A grammar that fails is reported by ``take_error`` once the build is done."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._building[request_id] = self._pool.submit(self._build, so)
        self.grammar_s[request_id] = 0.0

    def _build(self, so: StructuredOutputsParams) -> tuple[Any, float]:
        self.build_tokenizer()  # a no-op once built (start-up builds it when serving)
        t0 = time.perf_counter()
        grammar = grammar_of(so)
        check_syntax(grammar)
        matcher = build_matcher(self._tokenizer, grammar)
        return matcher, time.perf_counter() - t0

    def ready(self, request_id: str) -> bool:
        """True once ``request_id``'s matcher is built (or failed: ``take_error`` says)."""
        fut = self._building.get(request_id)
        return fut is None or fut.done()

    def take_error(self, request_id: str) -> BaseException | None:
        """Move a finished build into place; the build's error, if it failed (then freed)."""
        fut = self._building.pop(request_id, None)
        if fut is None:
            return None
        exc = fut.exception()
        if exc is not None:
            self.free(request_id)
            return exc
        matcher, build_s = fut.result()
        self._matchers[request_id] = matcher
        self.grammar_s[request_id] = self.grammar_s.get(request_id, 0.0) + build_s
        return None

    def wait_any(self, timeout_s: float) -> None:
        """Block until some build finishes or ``timeout_s`` passes (an idle engine's wait)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if self._building:
            wait(list(self._building.values()), timeout_s, return_when=FIRST_COMPLETED)

    def bitmasks(self, request_ids: list[str]) -> dict[str, np.ndarray]:
        """The allowed-token mask of each listed request that has a matcher."""
        rows = [rid for rid in request_ids if rid in self._matchers]
        if not rows:
            return {}
        masks = np.empty((len(rows), self._words), dtype=np.int32)
        out = {}
        for i, rid in enumerate(rows):
            t0 = time.perf_counter()
            fill_bitmask(self._matchers[rid], masks[i])
            self.grammar_s[rid] += time.perf_counter() - t0
            out[rid] = masks[i]
        return out

    def accept(self, request_id: str, token: int) -> bool:
        """Advance ``request_id``'s matcher by ``token``; True when the request must stop:
        the grammar is complete (nothing but EOS may follow) or the token was refused."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return False
        t0 = time.perf_counter()
        ok = matcher.consume_token(token)
        stopped = bool(matcher.is_stopped())
        self.grammar_s[request_id] += time.perf_counter() - t0
        if not ok:
            logger.warning("request %s: the grammar refused token %d (%s)", request_id, token,
                           _short(matcher.get_error()))
        return stopped or not ok

    def take_grammar_s(self, request_id: str) -> float | None:
        return self.grammar_s.get(request_id)

    def free(self, request_id: str) -> None:
        fut = self._building.pop(request_id, None)
        if fut is not None:
            fut.cancel()
        self._matchers.pop(request_id, None)
        self.grammar_s.pop(request_id, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
