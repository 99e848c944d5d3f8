"""What one request may be: token ids inside the vocabulary, a prompt that leaves room for an
output under ``max_model_len``, prompt + max_tokens that fit the KV pool.

Request validation, not scheduling: the input processor runs these checks above the engine (an
immediate 400 at the HTTP edge, a ``ValueError`` in ``LLM.generate`` before anything is queued),
and the engine runs the same functions again when a request is added, because it stays the
authority for whatever reaches it. Pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tailserve.errors import InvalidRequestError


class LengthLimits(Protocol):
    """The resolved engine limits a request's lengths are checked against (``RequestLimits``
    and the scheduler's ``SequenceLimits`` both carry them)."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_kv_blocks(self) -> int: ...


@dataclass(frozen=True)
class SequenceLimits:
    """The lengths alone: what the scheduler checks (it has no vocabulary to check against)."""

    max_model_len: int
    block_size: int
    num_kv_blocks: int


@dataclass(frozen=True)
class RequestLimits:
    """Every limit a request is validated against, resolved by the engine at start-up."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int


def check_prompt_token_ids(token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise ``InvalidRequestError`` (param ``prompt``) naming the first ids outside the
    vocabulary: the embedding lookup would fail on them, or read another token's row."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}", param="prompt"
        )


def check_request_lengths(limits: LengthLimits, n_prompt: int, max_tokens: int | None) -> int:
    """Raise ``InvalidRequestError`` (with the numbers) for a request that can never be served;
    return ``max_tokens`` resolved (``None`` -> the room left under max_model_len)."""
    if n_prompt == 0:
        raise InvalidRequestError("the prompt is empty (0 tokens)", param="prompt")
    max_model_len = limits.max_model_len
    if n_prompt >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {n_prompt} tokens but max_model_len is {max_model_len}; "
            f"at most {max_model_len - 1} prompt tokens leave room for one output token",
            param="input_tokens",
        )
    if max_tokens is None:
        max_tokens = max_model_len - n_prompt
    elif n_prompt + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) = "
            f"{n_prompt + max_tokens} exceeds max_model_len ({max_model_len})",
            param="max_tokens",
        )
    blocks_needed = -(-(n_prompt + max_tokens) // limits.block_size)
    if blocks_needed > limits.num_kv_blocks:
        raise InvalidRequestError(
            f"prompt + max_tokens = {n_prompt + max_tokens} tokens need {blocks_needed} KV "
            f"blocks but the whole pool has {limits.num_kv_blocks}",
            param="input_tokens",
        )
    return max_tokens
