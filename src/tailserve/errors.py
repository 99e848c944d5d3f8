"""User-facing errors.

A user mistake is a ``ValueError`` subclass carrying the numbers in its message and, where an
HTTP edge needs it, the OpenAI ``param`` it concerns. These never reach the engine loop: they
are raised when a request is built or added, and the edge maps them to 4xx.
"""

from __future__ import annotations


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
