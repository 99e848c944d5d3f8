"""User-facing errors.

A user mistake is a ``ValueError`` subclass carrying the numbers in its message and, where an
HTTP edge needs it, the OpenAI ``param`` it concerns. These never reach the engine loop: they
are raised when a request is built or added, and the edge maps them to 4xx.

The checks of user input that layers far apart make alike live here, the lowest layer, so each
rule and its message has one home: an SLO flag's milliseconds (the bench, tune, diagnose,
watch) and a user-given JSON object with known fields (``--kv-events-config``, the tenants'
keys file, the bench's ``--extra-body``).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

# Python's types as JSON names them, for "not a JSON object (an array)".
_JSON_TYPE_NAMES = {list: "an array", str: "a string", int: "a number", float: "a number",
                    bool: "true or false", type(None): "null"}


class InvalidRequestError(ValueError):
    """A request the engine will not accept. ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class ModelLoadError(ValueError):
    """A model path, file or architecture that cannot be loaded."""


class ConfigError(ValueError):
    """Engine arguments that contradict each other or the model."""


class QueueFullError(RuntimeError):
    """The waiting queue is at ``max_queue_len``: shed load (HTTP 429) instead of queueing."""

    reason = "queue_full"

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SLORefusedError(QueueFullError):
    """The predicted time to first token exceeds the request's TTFT SLO under
    ``--enable-slo-admission`` (HTTP 429): refused at once
    rather than queued to miss it; ``retry_after_s`` is when the queue ahead should be gone."""

    reason = "ttft_slo"

    def __init__(self, message: str, predicted_ttft_s: float, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s)
        self.predicted_ttft_s = predicted_ttft_s


class SLOUnattainableError(InvalidRequestError):
    """A request whose own prefill, on an idle engine, is predicted over its TTFT SLO:
    no amount of waiting admits it (HTTP 400, never a 429 a client would retry)."""


def check_valid_unicode(text: str, what: str, param: str | None) -> None:
    """Refuse a text holding a lone UTF-16 surrogate (JSON's ``"\\ud800"`` decodes to one).

    Such a string is a valid Python ``str`` but no valid Unicode: the tokenizer raises
    ``TypeError`` on it and msgpack cannot encode it as UTF-8, so it must be stopped where the
    request is built. ``what`` names the field in the message (``"stop[1]"``).
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        # Only surrogates fail to encode as UTF-8; exc.start is their index in ``text``.
        raise InvalidRequestError(
            f"{what} contains a lone surrogate (U+{ord(text[exc.start]):04X}) at index "
            f"{exc.start}; text must be valid Unicode",
            param=param,
        ) from None


def check_slo_ms(flag: str, ms: float, error: type[Exception] = ConfigError) -> None:
    """An SLO flag's value (``flag``: ``--slo-ttft-ms``) must be a positive, finite number of
    milliseconds; NaN fails too. ``error``: the caller's user-mistake type (``BenchError`` ...),
    so its command reports it as it reports every other flag."""
    if not 0 < ms < float("inf"):
        raise error(f"{flag} must be a positive number of milliseconds, got {ms:g}")


def json_object(value: str | dict[str, Any], what: str, known: Collection[str] | None = None,
                error: type[Exception] = ConfigError) -> dict[str, Any]:
    """``value`` (JSON text, or an already decoded dict) as a JSON object whose fields are all
    in ``known`` (None: any). ``what`` starts each message (``"kv_events_config"``,
    ``"api_keys 'keys.jsonl' line 3"``). A value that is not an object is named by its JSON
    type, never echoed: a keys file's line may be a bare secret."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            # exc.msg and the position, not str(exc): that says "line 1" of the value, which
            # reads as the wrong line when ``what`` names a line of a file.
            raise error(f"{what}: not JSON ({exc.msg} at character {exc.pos + 1})") from None
    if not isinstance(value, dict):
        kind = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
        raise error(f"{what}: not a JSON object ({kind})")
    if known is not None:
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise error(f"{what}: unknown field(s) {', '.join(unknown)}; known: "
                        f"{', '.join(sorted(known))}")
    return value
