"""Sampler: turn one step's batch of next-token logits into token ids (and logprobs).

Per row, in vLLM v1 / HF order::

    raw logits ─┬─▶ logprobs: log_softmax of the raw logits (vLLM v1's default "raw" mode)
                └─▶ min_tokens mask ─▶ penalties ─┬─▶ greedy rows (temperature 0): argmax
                                                  └─▶ random rows: / temperature ─▶ softmax
                                                      ─▶ top-k ─▶ top-p ─▶ min-p (together one
                                                         per-row logit threshold)
                                                      ─▶ exponential race (argmax probs / E)

Each stage is a few tensor ops over the whole batch with per-row parameter tensors. Python
loops over rows only build those small vectors (numpy on the host), draw a seeded row's noise
with its own generator, and build the (at most MAX_LOGPROBS + 1 entry) logprob dicts. A batch
that is all plain greedy (no penalties, min_tokens or logprobs) is a single argmax.

On CPU every argmax runs in numpy (``argmax_rows``): torch's CPU argmax over a 49k-152k
vocabulary is an unvectorized loop (~30 us a row on this host, ~5x numpy's) and enters an
OpenMP region from 8 rows on, which wakes OpenMP's sleeping threads against the kernels'
own pool every step (``OMP_WAIT_POLICY=PASSIVE``). Both return the first index of the
maximum and rank NaN above everything, so the tokens are the same.

Every tensor made from host values goes through ``row_tensor`` (``model/sampling_buffers.py``):
into the runner's persistent ``SamplingBuffers`` when it gave some (CUDA: pinned twins,
``non_blocking`` copies, nothing allocated per step), else a new tensor (CPU). top-k and top-p
are one per-row threshold, computed in ``model/top_k_top_p.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tailserve.model.grammar import apply_token_bitmasks
from tailserve.model.sampling_buffers import SamplingBuffers, row_tensor
from tailserve.model.top_k_top_p import top_k_top_p_threshold
from tailserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One request that samples this step, in batch row order."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    # Tokens generated so far, before this step's draw.
    output_token_ids: Sequence[int]
    # The model's EOS ids. Banned while min_tokens is unmet, unless ignore_eos (then EOS is an
    # ordinary token, not a stop, and banning it would skew the distribution — vLLM agrees).
    eos_token_ids: Sequence[int] = ()
    # Set for requests with params.seed, on the logits' device; each draw advances it, so a
    # seeded request's tokens depend only on its seed and its logits, never on its batch mates.
    generator: torch.Generator | None = None
    # Structured output: the packed allowed-token mask of this step (model/grammar.py), or
    # None for an unconstrained row.
    token_bitmask: np.ndarray | None = None


@dataclass
class SamplerOutput:
    """One step's result, in the rows' order."""

    token_ids: list[int]  # one per row
    # Per row: None unless params.logprobs is set; else {token_id: logprob} of the top-N tokens
    # (descending) plus the sampled token, from the raw (unprocessed) distribution.
    logprobs: list[dict[int, float] | None]


def _uses_penalties(params: SamplingParams) -> bool:
    return (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )


def _banned_for_min_tokens(row: SamplingRow) -> list[int]:
    """Token ids this row may not sample this step: its stops, while min_tokens is unmet."""
    if len(row.output_token_ids) >= row.params.min_tokens:
        return []
    banned = list(row.params.stop_token_ids)
    if not row.params.ignore_eos:
        banned.extend(row.eos_token_ids)
    return banned


def _is_plain_greedy(row: SamplingRow) -> bool:
    """True when argmax of the raw logits is the whole answer for this row."""
    params = row.params
    return (
        params.greedy
        and params.logprobs is None
        and not _uses_penalties(params)
        and len(row.output_token_ids) >= params.min_tokens
        and row.token_bitmask is None
    )


def _min_tokens_keys(rows: Sequence[SamplingRow], vocab_size: int) -> np.ndarray:
    """Flat keys ``row * vocab_size + token`` of the tokens each row may not sample this step;
    stop ids outside the vocabulary are skipped (the model cannot sample them anyway)."""
    parts: list[np.ndarray] = []
    for i, row in enumerate(rows):
        # Filtered in Python: a short list, and an id past int64 must not reach numpy.
        banned = [t for t in _banned_for_min_tokens(row) if 0 <= t < vocab_size]
        if banned:
            parts.append(np.asarray(banned, dtype=np.int64) + i * vocab_size)
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def apply_min_tokens(
    logits: torch.Tensor, rows: Sequence[SamplingRow], buffers: SamplingBuffers | None = None
) -> torch.Tensor:
    """Return logits with each row's stop tokens at -inf while it has fewer than min_tokens.

    ``logits`` is [num_rows, vocab_size]; it is not modified (the result is a new tensor, or
    ``logits`` itself when nothing is banned).
    """
    keys = _min_tokens_keys(rows, logits.shape[-1])
    if not keys.size:
        return logits
    index = row_tensor("min_tokens_keys", keys, logits.device, buffers)
    return logits.reshape(-1).index_fill(0, index, -math.inf).view(logits.shape)


def _flat_keys(
    token_lists: Sequence[Sequence[int]], row_numbers: Sequence[int], vocab_size: int
) -> np.ndarray:
    """Positions ``row * vocab_size + token`` in the flattened logits, one per listed token.

    Ids outside the vocabulary are dropped: the model cannot sample them, and left in they
    would address a neighbouring row.
    """
    parts = [np.empty(0, dtype=np.int64)]
    for tokens, row in zip(token_lists, row_numbers, strict=True):
        t = np.asarray(tokens, dtype=np.int64)
        parts.append(t[(t >= 0) & (t < vocab_size)] + row * vocab_size)
    return np.concatenate(parts)


def apply_penalties(
    logits: torch.Tensor, rows: Sequence[SamplingRow], vocab_size: int,
    buffers: SamplingBuffers | None = None,
) -> torch.Tensor:
    """Return float32 logits after repetition, then frequency and presence penalties.

    Repetition (HF/vLLM): a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied when not. Frequency and presence (OpenAI, output tokens
    only): ``logit -= frequency * count + presence * (count > 0)``. ``logits`` is
    [num_rows, vocab_size] and is not modified.

    Works on the distinct (row, token) pairs that occur rather than on dense
    [num_rows, vocab_size] count tensors: a step's prompts and outputs hold far fewer distinct
    tokens than that, and the dense form costs a dozen full passes over the batch (~100 ms for
    64 × 49152 on 2 CPU cores). Only rows that use a penalty contribute pairs.
    """
    penalized = [i for i, row in enumerate(rows) if _uses_penalties(row.params)]
    if not penalized:
        return logits.float()
    # The (row, token) bookkeeping on the host (numpy): the device gets three vectors.
    output_keys = _flat_keys([rows[i].output_token_ids for i in penalized], penalized,
                             vocab_size)
    # Prompt tokens only matter to the repetition penalty; skip them for rows without one.
    prompt_keys = _flat_keys(
        [
            rows[i].prompt_token_ids if rows[i].params.repetition_penalty != 1.0 else ()
            for i in penalized
        ],
        penalized,
        vocab_size,
    )
    keys, inverse = np.unique(np.concatenate([output_keys, prompt_keys]), return_inverse=True)
    if not keys.size:
        return logits.float()
    # Output occurrences of each distinct (row, token): the frequency count, 0 if prompt-only.
    counts = np.bincount(inverse[: output_keys.size], minlength=keys.size).astype(np.float32)

    def per_key(name: str) -> np.ndarray:  # [num_keys] float32: the key's row's value
        return np.array([getattr(row.params, name) for row in rows],
                        dtype=np.float32)[keys // vocab_size]

    subtract = per_key("frequency_penalty") * counts + per_key("presence_penalty") * (counts > 0)
    device = logits.device
    key_index = row_tensor("penalty_keys", keys, device, buffers)
    repetition = row_tensor("penalty_repetition", per_key("repetition_penalty"), device,
                             buffers)
    subtract_t = row_tensor("penalty_subtract", subtract, device, buffers)

    penalized_logits = torch.empty(logits.shape, dtype=torch.float32, device=device)
    penalized_logits.copy_(logits)  # one copy, contiguous even if ``logits`` is a padded slice
    flat = penalized_logits.view(-1)
    values = flat[key_index]
    # Every key was seen; rows with repetition_penalty 1 divide/multiply by 1, exactly a no-op.
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= subtract_t
    flat[key_index] = values
    return penalized_logits


# The dtypes whose CPU argmax runs in numpy (numpy has no bfloat16: those stay on torch).
_NUMPY_ARGMAX_DTYPES = (torch.float32, torch.float64, torch.float16)


def _numpy_argmax(x: torch.Tensor) -> np.ndarray | None:
    """Per-row argmax [num_rows] int64 of ``x`` [num_rows, vocab] in numpy (single-threaded,
    vectorized), or None where numpy cannot read it (a device tensor, bfloat16)."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_ARGMAX_DTYPES or x.requires_grad:
        return None
    return x.numpy().argmax(axis=-1)


def argmax_rows(x: torch.Tensor, buffers: SamplingBuffers | None = None) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x`` [num_rows, vocab], without an OpenMP region on CPU.
    With ``buffers`` (the CUDA step path, also run on CPU tensors by tests) it stays on torch:
    that path makes no tensor from host values."""
    found = _numpy_argmax(x) if buffers is None else None
    return x.argmax(dim=-1) if found is None else torch.from_numpy(found)


class Sampler:
    """Batched sampler for one engine step. See the module docstring for the order of steps."""

    def __init__(
        self, vocab_size: int, generator: torch.Generator | None = None,
        buffers: SamplingBuffers | None = None,
    ) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {vocab_size}")
        self.vocab_size = vocab_size
        # Persistent per-row parameter tensors (the runner's, on CUDA); None: new tensors.
        self.buffers = buffers
        # Noise for rows without their own generator; None means torch's default generator.
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row from ``logits`` [num_rows, >= vocab_size], any float dtype."""
        num_rows = len(rows)
        if logits.dim() != 2 or logits.shape[0] != num_rows or logits.shape[1] < self.vocab_size:
            raise ValueError(
                f"logits must be [num_rows={num_rows}, >= vocab_size={self.vocab_size}], "
                f"got {list(logits.shape)}"
            )
        # Columns past vocab_size (an lm_head padded for kernels) are never valid tokens.
        logits = logits[:, : self.vocab_size]
        if num_rows == 0:
            return SamplerOutput(token_ids=[], logprobs=[])
        if all(_is_plain_greedy(row) for row in rows):
            return SamplerOutput(argmax_rows(logits, self.buffers).tolist(), [None] * num_rows)

        logits = logits.float()  # raw, kept for logprobs; the steps below never modify it
        processed = apply_penalties(apply_min_tokens(logits, rows, self.buffers), rows,
                                    self.vocab_size, self.buffers)
        if any(row.token_bitmask is not None for row in rows):
            # Masked after the penalties, before temperature and truncation (vLLM's order);
            # logprobs stay those of the raw logits.
            wants_raw = any(r.params.logprobs is not None for r in rows)
            processed = apply_token_bitmasks(processed, [r.token_bitmask for r in rows],
                                             raw=logits if wants_raw else None)

        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if not random:
            token_ids = argmax_rows(processed, self.buffers)
        elif not greedy:
            token_ids = self._sample(processed, rows)
        else:
            device = logits.device
            greedy_index = row_tensor("greedy_index", greedy, device, self.buffers)
            random_index = row_tensor("random_index", random, device, self.buffers)
            token_ids = torch.empty(num_rows, dtype=torch.long, device=device)
            token_ids[greedy_index] = argmax_rows(processed[greedy_index], self.buffers)
            token_ids[random_index] = self._sample(
                processed[random_index], [rows[i] for i in random]
            )
        return SamplerOutput(token_ids.tolist(),
                             _gather_logprobs(logits, rows, token_ids, self.buffers))

    def _sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Draw one token per row of ``logits`` [num_random, vocab] (all rows temperature > 0)."""
        device = logits.device
        temperature = row_tensor(
            "temperature", [r.params.temperature for r in rows], device, self.buffers
        )
        scaled = logits / temperature.unsqueeze(1)
        probs = scaled.softmax(dim=-1)

        # top-k, top-p and min-p each keep the logits at or above a per-row threshold, so they
        # combine into one: the highest of the three.
        threshold: torch.Tensor | None = None
        top_k = [r.params.top_k for r in rows]
        top_p = [r.params.top_p for r in rows]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            threshold = top_k_top_p_threshold(scaled, probs, top_k, top_p, self.buffers)
        min_p = [r.params.min_p for r in rows]
        if any(p > 0.0 for p in min_p):
            # p_i < min_p * p_max  ⇔  logit_i < logit_max + log(min_p), and the top token
            # survives top-k/top-p, so this is the same after them. log(0) = -inf keeps all.
            log_min_p = row_tensor(
                "log_min_p", [math.log(p) if p > 0.0 else -math.inf for p in min_p], device,
                self.buffers,
            )
            min_p_threshold = scaled.amax(dim=-1, keepdim=True) + log_min_p.unsqueeze(1)
            threshold = (
                min_p_threshold if threshold is None else torch.maximum(threshold, min_p_threshold)
            )
        if threshold is not None:
            # Not renormalised: the race below is unchanged by scaling a row's probabilities.
            probs.masked_fill_(scaled < threshold, 0.0)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) is a draw from p, and each
        # row's draw depends only on its own noise row.
        noise = torch.empty_like(probs)
        seeded = [(i, r.generator) for i, r in enumerate(rows) if r.generator is not None]
        if len(seeded) < len(rows):
            noise.uniform_(generator=self.generator)  # one op for every unseeded row
        for i, generator in seeded:
            noise[i].uniform_(generator=generator)
        # E = -log(U): on CPU uniform_ + log is ~4x faster than exponential_. Clamping U inside
        # (0, 1) keeps E finite and > 0 (CUDA's uniform_ can return 1.0): a zero E would turn a
        # masked token's 0/0 into NaN, which argmax ranks highest.
        eps = torch.finfo(noise.dtype).eps
        noise.clamp_(torch.finfo(noise.dtype).tiny, 1.0 - eps / 2).log_().neg_()
        return argmax_rows(probs.div_(noise), self.buffers)


def _gather_logprobs(
    logits: torch.Tensor, rows: Sequence[SamplingRow], token_ids: torch.Tensor,
    buffers: SamplingBuffers | None = None,
) -> list[dict[int, float] | None]:
    """Top-N (descending) plus the sampled token's logprob, from log_softmax of raw logits."""
    result: list[dict[int, float] | None] = [None] * len(rows)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not wanted:
        return result
    index = row_tensor("logprob_index", wanted, logits.device, buffers)
    logprobs = torch.log_softmax(logits[index], dim=-1)  # [num_wanted, vocab] float32
    sampled = token_ids[index]
    sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1).tolist()
    top_n = [rows[i].params.logprobs or 0 for i in wanted]
    max_n = min(max(top_n), logprobs.shape[-1])
    top_logprobs: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if max_n > 0:
        values, ids = logprobs.topk(max_n, dim=-1)  # sorted descending
        top_logprobs, top_ids = values.tolist(), ids.tolist()
    for j, (i, n, token) in enumerate(zip(wanted, top_n, sampled.tolist(), strict=True)):
        entry = dict(zip(top_ids[j][:n], top_logprobs[j][:n], strict=True))
        entry.setdefault(token, sampled_logprobs[j])
        result[i] = entry
    return result
