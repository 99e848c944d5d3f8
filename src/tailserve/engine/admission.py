"""What a request must pass before it is queued: a KV need the pool can ever meet beyond the
watermark, and the queue bound counted on what can actually start. (The SLO checks are in
``engine/latency.py``.) Torch-free, like the scheduler.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from tailserve.engine.tenant_share import queue_share
from tailserve.errors import InvalidRequestError, QueueFullError
from tailserve.kv_groups import max_blocks_per_seq
from tailserve.request import Request

if TYPE_CHECKING:
    from tailserve.engine.scheduler import Scheduler


def check_admissible(s: Scheduler, req: Request) -> None:
    """Admission must leave the watermark free: a request whose admission needs more
    blocks than the pool holds beyond it would wait forever (and, at the head of the
    queue, hold everyone behind it)."""
    cfg = s.config
    tokens = req.num_prompt_tokens
    if cfg.admission_policy == "reserve":
        tokens += req.max_tokens
    elif cfg.enable_chunked_prefill:
        tokens = min(tokens, cfg.max_num_batched_tokens,
                     cfg.long_prefill_token_threshold or tokens)
    # Its first allocation starts at position 0, where no window has passed a block yet.
    need = max_blocks_per_seq(s.kv.group_windows, tokens, s.cache_config.block_size, tokens)
    room = s.cache_config.num_usable_blocks - s.kv.watermark_blocks
    if need > room:
        raise InvalidRequestError(
            f"admitting this request needs {need} KV blocks ({tokens} tokens) but the "
            f"pool holds {room} beyond the watermark ({s.cache_config.num_usable_blocks} "
            f"blocks, watermark {s.kv.watermark_blocks})", param="max_tokens",
        )


def check_queue_bound(s: Scheduler, req: Request) -> None:
    """``max_queue_len`` counts the requests that must wait: those the next step could
    start are not queued, as many, in queue order, as free ``max_num_seqs`` slots *and*
    free KV blocks (beyond the watermark, whole prompts) allow. Counting slots alone let a
    burst of 2,000-token prompts queue ``max_num_seqs + max_queue_len`` deep (63 waiting,
    76 s of queueing at ``--max-queue-len 16``) when 16-31 of them fit the pool. The
    refusal says the predicted wait, and Retry-After is when it should be over."""
    limit = s.config.max_queue_len
    if limit is None:
        return
    seats = max(0, s.config.max_num_seqs - len(s.running))
    free = s.kv.pool.num_free_blocks - s.kv.watermark_blocks
    startable = 0
    for r in [*s.waiting, req]:
        need = s.kv.blocks_for(r.num_tokens)
        if startable >= seats or need > free:
            break
        free -= need
        startable += 1
    # Those that must wait, this one included.
    queued = len(s.waiting) + 1 - startable
    if queued <= limit:
        return
    share = queue_share(s, req, limit)
    if share is None:
        why = (f"the waiting queue is full ({queued - 1} of {limit} waiting beyond the "
               f"{startable} that fit the free KV blocks and slots; {len(s.running)} of "
               f"{s.config.max_num_seqs} running)")
    else:
        # Several tenants: the full queue sheds the one over its share first; a tenant
        # within its share is queued still (the queue stays within about twice the
        # limit: the over-share ones no longer grow it).
        mine, places, why = share
        if mine < places:
            return
    predicted, idle = s.predict_ttft(req)
    wait = max(predicted - idle, 0.0)
    raise QueueFullError(f"{why}; predicted wait {wait * 1e3:.0f} ms",
                         retry_after_s=max(1.0, math.ceil(wait)))
