"""top-k and top-p as one per-row logit threshold (the sampler's truncation; min-p is a
threshold too and the sampler takes the highest of them).

top-k keeps the k highest logits; top-p keeps the smallest head whose probability mass, after
top-k, reaches top_p. Both are read off one ``topk`` of the highest logits rather than a sort of
the whole 49k-152k vocabulary (far cheaper on CPU); a row whose nucleus reaches past those
candidates is retried with more of them, up to the whole vocabulary.
"""

from __future__ import annotations

import math

import torch

from tailserve.model.sampling_buffers import SamplingBuffers, row_tensor

# top-k / top-p first look at this many highest logits (one topk, far cheaper than sorting a
# 49k-152k vocabulary on CPU); rows whose nucleus reaches past them retry with GROWTH times
# more, up to the whole vocabulary (a full sort).
TRUNCATION_CANDIDATES = 256
TRUNCATION_CANDIDATES_GROWTH = 16


def _keep_threshold(
    logits: torch.Tensor,
    probs: torch.Tensor,
    top_k: list[int],
    top_p: list[float],
    num_candidates: int,
    buffers: SamplingBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the lowest logit that top-k and then top-p keep, from the top candidates.

    ``probs`` is softmax(logits) (read only when some row uses top-p). Returns ``threshold``
    [num_rows, 1] (-inf for rows that truncate nothing) and ``resolved`` [num_rows] bool:
    False where the nucleus may extend past the candidates, so the threshold must be
    recomputed with more of them. With num_candidates == vocab every row is resolved.
    """
    vocab_size = logits.shape[-1]
    device = logits.device
    values, indices = logits.topk(num_candidates, dim=-1)  # [num_rows, num_candidates], desc
    top_k_on = row_tensor("top_k_on", [0 < k < vocab_size for k in top_k], device, buffers)
    top_p_on = row_tensor("top_p_on", [p < 1.0 for p in top_p], device, buffers)
    k = row_tensor("top_k", [k if 0 < k < vocab_size else num_candidates for k in top_k],
                    device, buffers)
    keep = torch.arange(num_candidates, device=device) < k.unsqueeze(1)  # a prefix per row
    resolved = torch.ones_like(top_k_on)
    if any(p < 1.0 for p in top_p):
        head = probs.gather(1, indices).masked_fill_(~keep, 0.0)
        # top-p measures mass after top-k (HF/vLLM): renormalise over the kept top-k where it
        # is on; elsewhere the candidates are only the head of the whole row's distribution.
        head_mass = head.sum(dim=-1, keepdim=True)
        head = torch.where(top_k_on.unsqueeze(1), head / head_mass, head)
        cumulative = head.cumsum(dim=-1)
        mass_before = cumulative - head  # exactly 0 for the top token, which is always kept
        # Rows with top_p == 1 must keep everything, but rounding can lift mass_before to 1.0
        # on the tail; an infinite bound makes them an exact no-op.
        bound = row_tensor("top_p_bound", [p if p < 1.0 else math.inf for p in top_p],
                            device, buffers)
        keep &= mass_before < bound.unsqueeze(1)  # mass_before only grows: still a prefix
        # A top_p below float32's smallest denormal (e.g. 5e-324) rounds to a bound of 0 and
        # would keep nothing (then gather at index -1 kills the step): the top token stays.
        keep[:, 0] = True
        if num_candidates < vocab_size:
            resolved = top_k_on | ~top_p_on | (cumulative[:, -1] >= bound)
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    threshold = values.gather(1, last_kept)
    threshold.masked_fill_(~(top_k_on | top_p_on).unsqueeze(1), -math.inf)
    return threshold, resolved


def top_k_top_p_threshold(
    logits: torch.Tensor, probs: torch.Tensor, top_k: list[int], top_p: list[float],
    buffers: SamplingBuffers | None = None,
) -> torch.Tensor:
    """[num_rows, 1]: per row, the lowest logit that top-k and then top-p keep.

    top-k keeps the k highest logits; top-p keeps the smallest head whose probability mass
    reaches top_p, which always includes the top token. ``probs`` is softmax(logits). Cuts are
    by value, so a token tied with the last kept one is kept too (as in vLLM).
    """
    vocab_size = logits.shape[-1]
    widest_k = max((k for k in top_k if 0 < k < vocab_size), default=0)
    num_candidates = min(vocab_size, max(TRUNCATION_CANDIDATES, widest_k))
    threshold, resolved = _keep_threshold(logits, probs, top_k, top_p, num_candidates, buffers)
    # Only a top-p row can outgrow its candidates; skip the device-to-host check otherwise.
    needs_check = num_candidates < vocab_size and any(p < 1.0 for p in top_p)
    pending = (~resolved).nonzero().squeeze(1).tolist() if needs_check else []
    while pending:
        num_candidates = min(vocab_size, num_candidates * TRUNCATION_CANDIDATES_GROWTH)
        index = row_tensor("pending_index", pending, logits.device, buffers)
        threshold[index], resolved = _keep_threshold(
            logits[index],
            probs[index],
            [top_k[i] for i in pending],
            [top_p[i] for i in pending],
            num_candidates,
            buffers,
        )
        pending = [i for i, done in zip(pending, resolved.tolist(), strict=True) if not done]
    return threshold
