"""Structured output's masks in the sampler: packed allowed-token bitmasks onto logits.

A mask is int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is allowed
(llguidance's layout, filled in the engine by ``engine/structured_output.py``). Only the rows
that carry one are touched: a batch without constrained rows never reaches this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch


def unpack_bitmask(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """[num_rows, vocab_size] bool from packed masks ``words`` [num_rows, num_words] int32;
    tokens past the mask's width are not allowed. numpy's unpackbits (little-endian bytes:
    bit t % 32 of word t // 32 is bit t % 8 of byte t // 8): ~400x torch's shifts on CPU."""
    packed = np.ascontiguousarray(words, dtype="<i4")
    bits = np.unpackbits(packed.view(np.uint8), axis=-1, bitorder="little")
    allowed = np.zeros((packed.shape[0], vocab_size), dtype=bool)
    width = min(vocab_size, bits.shape[1])
    allowed[:, :width] = bits[:, :width]
    return allowed


def apply_token_bitmasks(
    logits: torch.Tensor, masks: Sequence[np.ndarray | None], raw: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` [num_rows, vocab] with the disallowed tokens of each masked row at -inf.

    Written in place, except when ``logits`` is ``raw`` (the raw logits kept for logprobs):
    then the result is a copy. Rows without a mask are unchanged. On CPU the rows are masked
    in numpy: torch's masked_fill / index_put over a few rows cost 10-150 ms on this 2-core
    host (OpenMP regions against the kernels' threads), numpy's putmask 0.15 ms a row.
    """
    rows = [i for i, m in enumerate(masks) if m is not None]
    if not rows:
        return logits
    if raw is not None and logits.data_ptr() == raw.data_ptr():
        logits = logits.clone()
    allowed = unpack_bitmask(np.stack([m for m in masks if m is not None]), logits.shape[-1])
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        values = logits.numpy()
        for j, i in enumerate(rows):
            np.putmask(values[i], ~allowed[j], -np.inf)
        return logits
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    disallowed = ~torch.from_numpy(allowed).to(logits.device)
    logits[index] = logits[index].masked_fill(disallowed, -math.inf)
    return logits
