"""SamplingParams: how one request's tokens are chosen and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tailserve.errors import InvalidRequestError, check_valid_unicode

# Top-N logprobs are computed with one topk over the vocabulary; the cap keeps that op bounded.
MAX_LOGPROBS = 20
MAX_N = 16
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1
# Temperatures below this sample greedily (as vLLM does): logits / 1e-40 overflow to inf and
# the softmax turns to NaN, which would pick token 0 every step.
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A grammar the output must match (vLLM's ``StructuredOutputsParams``): exactly one of a
    JSON schema (serialized), a regex, a choice of strings, a Lark or GBNF grammar, or any JSON
    object. The engine turns it into a token matcher (``engine/structured_output.py``)."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                "structured output needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {len(given)}" + (f" ({', '.join(given)})" if given else ""),
                param="structured_outputs",
            )
        if self.choice is not None:
            object.__setattr__(self, "choice", list(self.choice))
            if not self.choice or any(not isinstance(c, str) for c in self.choice):
                raise InvalidRequestError(
                    "structured_outputs.choice must be a non-empty list of strings",
                    param="structured_outputs",
                )


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; validated on construction (``InvalidRequestError``).

    Frozen: one object may be shared by many requests (``LLM.generate`` with one params for
    every prompt, the ``n`` completions of a prompt), so nothing may change it after the caller
    made it. Derive a variant with ``dataclasses.replace``. ``stop`` and ``stop_token_ids``
    are copied on construction, so the caller's lists are not shared either.

    ``temperature == 0`` (or below 1e-5) means greedy. ``top_k == 0`` (or -1, as vLLM users
    write it) disables top-k; below -1 is an error. ``seed`` makes the request's draws
    reproducible regardless of its batch mates.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # Normalization of a frozen dataclass: the only writes, before anyone holds the object.
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        # -1 is how vLLM users write "disabled"; below it is a mistake (checked in _validate).
        if self.top_k is None or self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        if self.top_k < 0:
            raise InvalidRequestError(
                f"top_k must be -1 or 0 (disabled) or a positive number, got {self.top_k}",
                param="top_k",
            )
        # The n children of a seeded request draw with seed + i; every one of them must still
        # be an int64 (the wire format and torch.Generator.manual_seed both take one).
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            raise InvalidRequestError(
                f"seed must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] with n {self.n}, "
                f"got {self.seed}", param="seed",
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens"
            )
        if self.min_tokens < 0:
            raise InvalidRequestError(
                f"min_tokens must be >= 0, got {self.min_tokens}", param="min_tokens"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        if not math.isfinite(self.temperature):  # NaN and inf pass a plain "< 0" check
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}",
                param="temperature",
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if not 0 < self.repetition_penalty < math.inf:  # written so that NaN fails it too
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", param=name)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must be non-empty", param="stop")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise InvalidRequestError(
                    f"stop[{i}] must be a string, got {type(s).__name__}", param="stop"
                )
            check_valid_unicode(s, f"stop[{i}]", "stop")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS
