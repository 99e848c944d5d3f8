"""What the prefix cache gained and lost, as the block manager reports it (plain values).

The block pool records one of these whenever a block hash enters or leaves its prefix-cache
map; the scheduler drains them into each step's ``SchedulerOutput.kv_events`` and the edge
(``obs/kv_events.py``) publishes them in vLLM's KV-events wire format, so a router can mirror
which prefixes this engine holds.
Hashes are the pool's chained 64-bit block hashes (``kv.block_pool.hash_block``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one request became findable, in prompt order.

    ``parent_block_hash`` is the hash of the block before the first one (None at the start of
    a sequence); ``token_ids`` are the tokens of all ``block_hashes`` blocks, concatenated.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes are no longer in the cache (their blocks were taken for new tokens)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Nothing is cached any more (or, as the first event of an engine, nothing was yet)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
