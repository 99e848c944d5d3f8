"""BlockPool: the fixed set of KV block ids, their reference counts and the prefix cache.

Torch-free and deterministic. The device tensor behind the ids is allocated once by the model
runner; this pool only decides which id holds what.

Free blocks sit in one LRU queue. A freed block keeps its contents and its hash, so a later
request with the same prefix can take it back (a prefix-cache hit); a new allocation takes the
least recently freed block and evicts whatever it cached::

    free queue:  [evicted first ... most recently freed]
                  ^ get_new_blocks pops here      free_blocks appends here ^
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import xxhash

from tailserve.data.kv_events import BlockRemoved, KVCacheEvent


@dataclass(frozen=True)
class BlockHash:
    """The chained hash of a full block: its tokens and the hash of the block before it.

    ``value`` is the 64-bit key; ``parent`` and ``token_ids`` are kept to guard collisions.
    """

    value: int
    parent: int | None
    token_ids: tuple[int, ...]


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    parent_value = parent.value if parent is not None else None
    h = xxhash.xxh64()
    h.update(b"root" if parent_value is None else parent_value.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids))
    return BlockHash(h.intdigest(), parent_value, tuple(token_ids))


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


# Block ids are grouped into this many bands of consecutive ids; the pool counts the blocks in
# use per band as they change (O(1) per block), for the dashboard's KV-usage heatmap.
NUM_USAGE_BANDS = 32


def usage_band_sizes(num_blocks: int, num_bands: int) -> list[int]:
    """How many block ids fall in each band (block ``i`` is in band ``i * num_bands // n``)."""
    n, nb = num_blocks, num_bands
    return [-(-(b + 1) * n // nb) - -(-b * n // nb) for b in range(nb)]


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Hashes entering and leaving ``_cached``, in order, until the engine drains them
        # (``take_events``); None when nobody listens, so the hot path appends nothing.
        self._events: list[KVCacheEvent] | None = [] if enable_kv_cache_events else None
        self.num_bands = min(NUM_USAGE_BANDS, num_blocks)
        # Blocks with ref_cnt > 0 per band of ids (see usage_band_sizes).
        self.band_used = [0] * self.num_bands
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, including those that still hold a cached prefix."""
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        evicted: list[int] = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                # Evict: the block is about to be overwritten.
                if self._cached.get(block.block_hash.value) is block:
                    del self._cached[block.block_hash.value]
                    evicted.append(block.block_hash.value)
                block.block_hash = None
            block.ref_cnt = 1
            self.band_used[block_id * self.num_bands // self.num_blocks] += 1
            out.append(block)
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block with exactly this content and parent, or None (miss or collision)."""
        block = self._cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self.band_used[block.block_id * self.num_bands // self.num_blocks] += 1
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full block. A twin already cached stays the one found by lookups.

        True when the hash is new to the cache (what a ``BlockStored`` event announces).
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        block.block_hash = block_hash
        return self._cached.setdefault(block_hash.value, block) is block

    def record_event(self, event: KVCacheEvent) -> None:
        """Queue an event for ``take_events`` (dropped when events are off)."""
        if self._events is not None:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first; empty when events are off."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def cached_block_hashes(self) -> set[int]:
        """Every hash a lookup can find now: what the events, replayed, must add up to."""
        return set(self._cached)

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                self.band_used[block.block_id * self.num_bands // self.num_blocks] -= 1

    def free_block_ids(self) -> list[int]:
        """In eviction order; for tests and invariant checks."""
        return list(self._free)
