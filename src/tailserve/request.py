"""Request: one sequence's state inside the engine, its status and its timestamps; and what a
request may be (``RequestLimits`` and the checks against them)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tailserve.errors import InvalidRequestError
from tailserve.kv_groups import blocks_per_seq
from tailserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered: every status greater than ``PREEMPTED`` is finished."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


class FinishReason(str, enum.Enum):
    """OpenAI's finish_reason words."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    # Written at the edge when the engine died under a request; no engine status maps to it.
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(frozen=True)
class SLO:
    """The latency a request is held to (seconds; None: not held to that one). ``ttft_s``: its
    first token within that of its arrival; ``itl_s``: every next token within that of the one
    before (the per-token deadline the scheduler serves); ``tpot_s``: the mean gap after the
    first token within that."""

    ttft_s: float | None = None
    itl_s: float | None = None
    tpot_s: float | None = None

    def over(self, default: SLO) -> SLO:
        """These values where given, ``default``'s elsewhere (a per-request override over the
        server's SLO)."""
        return SLO(
            self.ttft_s if self.ttft_s is not None else default.ttft_s,
            self.itl_s if self.itl_s is not None else default.itl_s,
            self.tpot_s if self.tpot_s is not None else default.tpot_s,
        )


@dataclass
class RequestTimestamps:
    """Engine-stamped, ``time.monotonic()`` seconds. Lists grow once per preemption."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    preempted: list[float] = field(default_factory=list)
    resumed: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_steps_with_prefill: int = 0
    # Time this request spent in steps that also carried prefill tokens (its own or others').
    time_in_steps_with_prefill: float = 0.0
    # Sum of the steps in which this request was computing its prompt (own prefill).
    prefill_time: float = 0.0
    # The latest output token, and the longest gap between two consecutive ones (the ITL SLO
    # is met when that is within it).
    last_token: float | None = None
    max_itl: float = 0.0
    # Structured output: its matcher's build (in a worker thread) and its masks and advances.
    grammar_s: float = 0.0


@dataclass
class Request:
    """A single sequence. ``n > 1`` is expanded into several Requests above the engine.

    Invariant: ``all_token_ids == prompt_token_ids + output_token_ids`` and
    ``num_computed_tokens <= num_tokens``. A preempted request keeps its output tokens and
    recomputes them as part of its next prefill, so its answer does not change.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    eos_token_ids: tuple[int, ...] = ()
    # Prefix-cache isolation (vLLM's ``cache_salt``): cached blocks are shared only among
    # requests with the same salt (None: the unsalted pool).
    cache_salt: str | None = None
    # The tenant that sent it (the API key's name, ``--api-keys``; None: the one default
    # tenant) and its weight: waiting requests are served fair-share across tenants
    # (``engine/tenant_share.py``); with one tenant the schedule is the policy's alone.
    tenant: str | None = None
    tenant_weight: float = 1.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Sampled-token logprobs: one entry per output token, {token_id: logprob} (top-N + sampled).
    logprobs: list[dict[int, float]] | None = None
    timestamps: RequestTimestamps = field(init=False)
    all_token_ids: list[int] = field(init=False)
    # The order in which requests were admitted; preemption picks the newest admission.
    admit_seq: int = 0
    # What the request asked for (headers, body); the scheduler puts the server's SLO under
    # it when the request is added. ``slo_given_ttft``: the TTFT SLO came with the request.
    slo: SLO = field(default_factory=SLO)
    slo_given_ttft: bool = field(init=False, default=False)
    # The output budget: ``sampling_params.max_tokens``; a None there is resolved to the room
    # left under max_model_len when the scheduler adds the request (it is 0 until then). Kept
    # here because ``SamplingParams`` is frozen: it stays what the caller asked for.
    max_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.timestamps = RequestTimestamps(arrival=self.arrival_time)
        mt = self.sampling_params.max_tokens
        self.max_tokens = mt if mt is not None else 0
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def timing(self) -> dict[str, Any]:
        """The ``tailserve_timing`` dict (docs/DESIGN.md), from the engine's timestamps."""
        ts = self.timestamps
        end = ts.finished if ts.finished is not None else time.monotonic()
        queue_s = (ts.first_scheduled - ts.arrival) if ts.first_scheduled is not None else (
            end - ts.arrival
        )
        ttft_s = (ts.first_token - ts.arrival) if ts.first_token is not None else None
        decode_s = (end - ts.first_token) if ts.first_token is not None else 0.0
        preempted_s = 0.0
        for i, t0 in enumerate(ts.preempted):
            t1 = ts.resumed[i] if i < len(ts.resumed) else end
            preempted_s += t1 - t0
        return {
            "queue_s": queue_s,
            "prefill_s": ts.prefill_time,
            "ttft_s": ttft_s,
            "decode_s": decode_s,
            "e2e_s": end - ts.arrival,
            "num_steps": ts.num_steps,
            "num_steps_with_prefill": ts.num_steps_with_prefill,
            "time_in_steps_with_prefill_s": ts.time_in_steps_with_prefill,
            "num_preemptions": self.num_preemptions,
            "preempted_s": preempted_s,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_prompt_tokens": self.num_cached_tokens,
            "output_tokens": self.num_output_tokens,
            "grammar_s": ts.grammar_s,
            **({"slo": self.slo_attainment(ttft_s)} if self.slo.ttft_s is not None else {}),
            **({"tenant": self.tenant} if self.tenant is not None else {}),
        }

    def next_token_deadline(self) -> float | None:
        """When the next output token is due: the first by the TTFT SLO, every later one by
        the ITL SLO after the one before (None: no SLO on it)."""
        ts = self.timestamps
        if ts.last_token is None:
            return None if self.slo.ttft_s is None else ts.arrival + self.slo.ttft_s
        return None if self.slo.itl_s is None else ts.last_token + self.slo.itl_s

    def slo_attainment(self, ttft_s: float | None) -> dict[str, Any]:
        """The SLO this request was held to and whether it met each part (``tailserve_timing``'s
        ``slo``): ITL met = every gap between consecutive output tokens within ``itl_s``;
        TPOT met = their mean within ``tpot_s``. With one output token there is no gap: met."""
        slo, ts = self.slo, self.timestamps
        gaps = self.num_output_tokens - 1
        tpot = ((ts.last_token - ts.first_token) / gaps
                if gaps > 0 and ts.last_token is not None and ts.first_token is not None else 0.0)
        return {
            "ttft_s": slo.ttft_s, "itl_s": slo.itl_s, "tpot_s": slo.tpot_s,
            "ttft_met": ttft_s is not None and slo.ttft_s is not None and ttft_s <= slo.ttft_s,
            "itl_met": None if slo.itl_s is None else ts.max_itl <= slo.itl_s,
            "tpot_met": None if slo.tpot_s is None else tpot <= slo.tpot_s,
        }


# ---------------------------------------------------------------- what a request may be
# Request validation, not scheduling: the input processor runs these checks above the engine
# (an immediate 400 at the HTTP edge, a ``ValueError`` in ``LLM.generate`` before anything is
# queued), and the engine runs the same functions again when a request is added, because it
# stays the authority for whatever reaches it. Pure and torch-free.
class LengthLimits(Protocol):
    """The resolved engine limits a request's lengths are checked against (``RequestLimits``
    and the scheduler's ``SequenceLimits`` both carry them)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def max_request_tokens(self) -> int: ...

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]: ...


@dataclass(frozen=True)
class SequenceLimits:
    """The lengths alone: what the scheduler checks (it has no vocabulary to check against).
    The scheduler sees one sequence at a time, so it applies ``max_request_tokens`` with n=1."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int
    max_request_tokens: int
    kv_group_windows: tuple[int | None, ...] = (None,)  # kv_groups.py


@dataclass(frozen=True)
class RequestLimits:
    """Every limit a request is validated against, resolved by the engine at start-up."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    # The most tokens one request may ask for, n x (prompt + max_tokens): by default the
    # pool's total, so a request whose sequences could never all be in the pool at once (and
    # would run for as long as several requests in a row) is refused up front.
    max_request_tokens: int
    # The KV cache groups' windows (kv_groups.py): what one sequence holds of the pool.
    kv_group_windows: tuple[int | None, ...] = (None,)


def check_stop_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` (param ``stop_token_ids``) for ids outside the vocabulary:
    the model can never sample them, so the stop could never fire."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids must be in [0, {vocab_size}); got {bad[:5]}",
            param="stop_token_ids",
        )


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` (param ``prompt``) naming the first ids outside the
    vocabulary: the embedding lookup would fail on them, or read another token's row."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt"
        )


def check_request_lengths(
    limits: LengthLimits, n_prompt: int, max_tokens: int | None, n: int = 1
) -> int:
    """Raise ``InvalidRequestError`` (with the numbers) for a request of ``n`` sequences that
    can never be served; return ``max_tokens`` resolved (``None`` -> the room left under
    max_model_len and under ``max_request_tokens`` shared by the ``n`` sequences)."""
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty (0 tokens)", param="prompt")
    max_model_len = limits.max_model_len
    cap = limits.max_request_tokens
    if n_prompt >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n_prompt} tokens but max_model_len is {max_model_len}; "
            f"at most {max_model_len - 1} prompt tokens leave room for one output token",
            param="input_tokens",
        )
    if max_tokens is None:
        # vLLM's reading of a missing budget (up to max_model_len), bounded by the per-request
        # cap so that a careless client cannot hold the engine for minutes.
        max_tokens = min(max_model_len - n_prompt, cap // n - n_prompt)
        if max_tokens < 1:
            raise InvalidRequestError(
                f"n ({n}) x (prompt ({n_prompt} tokens) + 1 output token) = "
                f"{n * (n_prompt + 1)} tokens exceeds max_request_tokens ({cap})",
                param="n" if n > 1 else "input_tokens",
            )
    elif n_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{n_prompt + max_tokens} exceeds max_model_len ({max_model_len})",
            param="max_tokens",
        )
    blocks_needed = blocks_per_seq(limits.kv_group_windows, n_prompt + max_tokens,
                                   limits.block_size)
    if blocks_needed > limits.num_kv_blocks:
        raise InvalidRequestError(
            f"prompt + max_tokens = {n_prompt + max_tokens} tokens need {blocks_needed} KV "
            f"blocks but the whole pool has {limits.num_kv_blocks}",
            param="input_tokens",
        )
    total = n * (n_prompt + max_tokens)
    if total > cap:
        raise InvalidRequestError(
            f"n ({n}) x (prompt ({n_prompt} tokens) + max_tokens ({max_tokens})) = {total} "
            f"tokens exceeds max_request_tokens ({cap})",
            # n is the field to lower when one sequence alone would fit.
            param="n" if n > 1 and n_prompt + max_tokens <= cap else "max_tokens",
        )
    return max_tokens
