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

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

from tailserve.data.kv_events import BlockRemoved, KVCacheEvent

# How full blocks are keyed: ``sha256`` (the default) chains SHA-256 digests, so equal keys
# mean equal token chains from the root, salt included, even against crafted prompts; ``xxh64``
# chains 64-bit xxHash values (faster, but not built to resist crafted collisions: opt in only
# where every client is trusted). Measured per 4,000-token prompt in benchmarks/block_hashing.py.
HashAlgo = Literal["sha256", "xxh64"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "xxh64")


@dataclass(frozen=True)
class BlockHash:
    """The chained hash of a full block: its tokens, the block before it and, for a first
    block, the request's cache salt.

    ``digest`` is the cache key: under ``sha256`` it commits to the whole chain of tokens from
    the root and the salt. ``value`` is its first 8 bytes as a little-endian integer, the
    64-bit hash KV events carry (what routers key on); ``parent`` the parent's ``value``.
    ``token_ids`` are kept to guard the key.
    """

    digest: bytes
    value: int
    parent: int | None
    token_ids: tuple[int, ...]


def _root(salt: str | None) -> bytes:
    """A first block's chain head. A salt is length-prefixed after a marker byte: salted and
    unsalted heads differ in length, so no token sequence makes one the other."""
    if salt is None:
        return b"root"
    encoded = salt.encode()
    return b"root\x01" + len(encoded).to_bytes(4, "little") + encoded


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], *,
               salt: str | None = None, algo: HashAlgo = "sha256") -> BlockHash:
    """``salt`` counts only for a first block (``parent`` None): every later block inherits it
    through the chain."""
    tokens = struct.pack(f"<{len(token_ids)}i", *token_ids)  # 4 little-endian bytes each
    if algo == "sha256":
        head = parent.digest if parent is not None else _root(salt)
        digest = hashlib.sha256(head + tokens).digest()
        value = int.from_bytes(digest[:8], "little")
    else:
        x = xxhash.xxh64()
        x.update(_root(salt) if parent is None else parent.value.to_bytes(8, "little"))
        x.update(tokens)
        value = x.intdigest()
        digest = value.to_bytes(8, "little")
    return BlockHash(digest, value, parent.value if parent is not None else None,
                     tuple(token_ids))


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # The KV cache group whose cache holds it (``kv_groups.py``): the same token chain
    # is a different block in each group.
    group: int = 0
    # The pool's null block (id 0 where some group releases blocks): what a released slot
    # of a block table points at. Never allocated, cached or freed.
    is_null: bool = False


def _cache_key(block_hash: BlockHash, group: int) -> bytes:
    """Group 0 keys by the digest alone (what KV events and routers see); a later group's
    key is longer, so it never equals a group-0 key."""
    return block_hash.digest if group == 0 else block_hash.digest + group.to_bytes(2, "little")


# Block ids are grouped into this many bands of consecutive ids; the pool counts the blocks in
# use per band as they change (O(1) per block), for the dashboard's KV-usage heatmap.
NUM_USAGE_BANDS = 32


def usage_band_sizes(num_blocks: int, num_bands: int) -> list[int]:
    """How many block ids fall in each band (block ``i`` is in band ``i * num_bands // n``)."""
    n, nb = num_blocks, num_bands
    return [-(-(b + 1) * n // nb) - -(-b * n // nb) for b in range(nb)]


class BlockPool:
    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_kv_cache_events: bool = False,
        reserve_null_block: bool = False,
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
        # With a null block, id 0 is never handed out (counted as in use): what it holds is
        # finite (the runner's zeros, or start-up calibration's K/V), so a masked read of a
        # released slot weighs nothing.
        first = 1 if reserve_null_block and num_blocks else 0
        self.null_block: KVBlock | None = None
        if first:
            self.null_block = self.blocks[0]
            self.null_block.is_null = True
            self.band_used[0] += 1
        self._free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(first, num_blocks))
        self._cached: dict[bytes, KVBlock] = {}  # by _cache_key

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
                key = _cache_key(block.block_hash, block.group)
                if self._cached.get(key) is block:
                    del self._cached[key]
                    if block.group == 0:
                        evicted.append(block.block_hash.value)
                block.block_hash = None
            block.ref_cnt = 1
            self.band_used[block_id * self.num_bands // self.num_blocks] += 1
            out.append(block)
        if evicted and self._events is not None:
            self._events.append(BlockRemoved(tuple(evicted)))
        return out

    def lookup(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        """The cached block with exactly this content and parent in ``group``'s cache, or None
        (miss or collision)."""
        block = self._cached.get(block_hash.digest if group == 0 else _cache_key(block_hash, group))
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue (the
        null block of a local group's hits is skipped)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                del self._free[block.block_id]
                self.band_used[block.block_id * self.num_bands // self.num_blocks] += 1
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int = 0) -> bool:
        """Register a full block in ``group``'s cache. A twin already cached stays the one
        found by lookups.

        True when the hash is new to the cache (what a ``BlockStored`` event announces).
        """
        if not self.enable_caching or block.block_hash is not None or block.is_null:
            return False
        block.block_hash = block_hash
        block.group = group
        return self._cached.setdefault(_cache_key(block_hash, group), block) is block

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
        """Every hash (64-bit value) a group-0 lookup can find now: what the events, replayed,
        must add up to (events describe group 0's cache only)."""
        return {block.block_hash.value for block in self._cached.values()
                if block.block_hash is not None and block.group == 0}

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks in the order they should be evicted (the null
        block of a released slot is skipped)."""
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None
                self.band_used[block.block_id * self.num_bands // self.num_blocks] -= 1

    def free_block_ids(self) -> list[int]:
        """In eviction order; for tests and invariant checks."""
        return list(self._free)
