"""KVCacheManager: block tables per request, prefix-cache lookups and the admission watermark.

Torch-free and deterministic. A request's block table covers its computed tokens plus the
tokens scheduled this step::

    tokens:  |<- num_computed_tokens ->|<- num_new_tokens ->|
    blocks:  [b0][b1][b2]...                         [bk]  <- allocated up to here

Full blocks whose tokens are known are hashed (chained, see ``block_pool.hash_block``) and
registered in the pool as soon as they are scheduled, so a request admitted later in the same
step can already share them: K/V are written before attention reads them in every layer.

A sliding-window model has several KV cache groups (``kv_groups.py``), each with its own
table per request: ``req_to_blocks`` holds group 0's, ``group_blocks`` the others'. A local
group's table releases the blocks wholly before the window of the next token to compute (the
slot then holds the null block)::

    global:  [b0][b1][b2][b3][b4][b5]
    local:   [--][--][--][b9][b7][b8]    window: the last W positions before the next token

A prefix-cache hit of ``h`` blocks is claimed only where every group still has what it would
read: each global group blocks ``0 .. h-1``, each local group the blocks of the window before
position ``h * block_size``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from tailserve.data.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent
from tailserve.data.records import KVCacheSnapshot
from tailserve.kv.block_pool import BlockHash, BlockPool, HashAlgo, KVBlock, hash_block
from tailserve.kv_groups import blocks_per_seq, cdiv, first_needed_block
from tailserve.request import Request

__all__ = ["KVCacheManager", "cdiv"]

_BLOCK_ID = operator.attrgetter("block_id")


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
        enable_kv_cache_events: bool = False,
        hash_algo: HashAlgo = "sha256",
        group_windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.hash_algo: HashAlgo = hash_algo
        self.enable_caching = enable_caching
        # Each KV cache group's window (None: global), group 0 first.
        self.group_windows = tuple(group_windows)
        # The plain path (one global group) keeps its fast paths; anything else is grouped.
        self.grouped = self.group_windows != (None,)
        releases = any(w is not None for w in self.group_windows)
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events,
                              reserve_null_block=releases)
        # A subscriber that outlived an earlier engine at the same endpoint must forget what
        # that one held: the first event of every engine says the cache is empty.
        self.pool.record_event(AllBlocksCleared())
        # Free blocks that admitting a *new* request must leave, so running requests can grow.
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # Groups 1 .. n-1's tables per request (grouped only), the same length rules.
        self.group_blocks: dict[str, list[list[KVBlock]]] = {}
        # Per request and group, how many leading slots are released (null).
        self._released: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._req_num_cached: dict[str, int] = {}
        # Counted in tokens, as vLLM does: queries = prompt tokens looked up, hits = found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def snapshot(self) -> KVCacheSnapshot:
        """Block counts and prefix-cache totals now, as a frozen value for stats and gauges."""
        return KVCacheSnapshot(
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            band_used=tuple(self.pool.band_used),
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
        )

    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's table (the only one unless ``grouped``)."""
        # map over attrgetter: ~2x a list comprehension, once per scheduled request per step.
        return list(map(_BLOCK_ID, self.req_to_blocks.get(request_id, ())))

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Groups 1 .. n-1's tables (empty unless ``grouped``); a released slot is block 0."""
        return tuple(list(map(_BLOCK_ID, t)) for t in self.group_blocks.get(request_id, ()))

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of ``num_tokens`` tokens holds over all groups."""
        if not self.grouped:
            return cdiv(num_tokens, self.block_size)
        return blocks_per_seq(self.group_windows, num_tokens, self.block_size)

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds over all groups (released slots not counted)."""
        tables = [self.req_to_blocks.get(request_id, []), *self.group_blocks.get(request_id, ())]
        return sum(1 for t in tables for b in t if not b.is_null)

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The request's chained hashes for its first ``num_full_blocks`` blocks (memoized)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            # The salt enters at the root: requests share blocks only with the same salt.
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs],
                                     salt=request.cache_salt, algo=self.hash_algo))
        return hashes[:num_full_blocks]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's known tokens, as blocks and a token count.

        At least one token is always left to compute, since the step must produce its logits.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.grouped:
            num_hit = self._grouped_hit_blocks(request, max_hit_blocks)
            return self._group_hits(request, 0, num_hit), num_hit * self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(request, max_hit_blocks):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _grouped_hit_blocks(self, request: Request, max_hit_blocks: int) -> int:
        """The longest hit, in blocks, that every group can serve: a global group needs each
        block before it, a local group the blocks of the window before it."""
        hashes = self._block_hashes(request, max_hit_blocks)
        lookup = self.pool.lookup
        num_hit = max_hit_blocks
        for g, window in enumerate(self.group_windows):
            if window is not None:
                continue
            n = 0
            while n < num_hit and lookup(hashes[n], g) is not None:
                n += 1
            num_hit = n
        bs = self.block_size
        local = [(g, w) for g, w in enumerate(self.group_windows) if w is not None]
        # A shorter hit reads another window: repeat until every local group agrees.
        settled = False
        while not settled and num_hit:
            settled = True
            for g, window in local:
                # missing_before[e]: 1 + the last missing block index below e (0: none).
                missing_before = [0] * (num_hit + 1)
                for i in range(num_hit):
                    missing = lookup(hashes[i], g) is None
                    missing_before[i + 1] = i + 1 if missing else missing_before[i]
                end = num_hit
                while end > 0 and missing_before[end] > first_needed_block(end * bs, window, bs):
                    end -= 1
                if end != num_hit:
                    num_hit, settled = end, False
        return num_hit

    def _group_hits(self, request: Request, group: int, num_hit: int) -> list[KVBlock]:
        """Group ``group``'s cached blocks for a hit of ``num_hit`` blocks, the slots before a
        local group's window null (``_grouped_hit_blocks`` found every one of them)."""
        if num_hit == 0:
            return []
        hashes = self._block_hashes(request, num_hit)
        window = self.group_windows[group]
        first = 0 if window is None else first_needed_block(
            num_hit * self.block_size, window, self.block_size)
        null = self.pool.null_block
        hits: list[KVBlock] = []
        for i in range(num_hit):
            block = self.pool.lookup(hashes[i], group) if i >= first else null
            if block is None:
                raise RuntimeError(f"group {group} lost cached block {i} of a prefix hit")
            hits.append(block)
        return hits

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Counted once per admission, not once per attempt of a request held in the queue."""
        if self.enable_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        *,
        apply_watermark: bool = False,
        reserve_up_to: int | None = None,
    ) -> bool:
        """Grow the request's block table for ``num_new_tokens`` more tokens.

        ``new_computed_blocks`` are prefix-cache hits to adopt first (fresh admissions only).
        ``reserve_up_to`` allocates for that many tokens in total at once (reserve admission).
        Returns False, changing nothing, when the pool (less the watermark) cannot serve it.
        """
        if self.grouped:
            return self._allocate_grouped(request, num_new_tokens, new_computed_blocks,
                                          apply_watermark, reserve_up_to)
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks and not new_computed_blocks and reserve_up_to is None and not apply_watermark:
            # The steady decode: the new tokens fit in the blocks it holds, so the pool is
            # not asked (what the general path below does when it needs no block).
            after = request.num_computed_tokens + num_new_tokens
            if after <= len(blocks) * self.block_size:
                self._cache_full_blocks(request, min(after, request.num_tokens))
                return True
        if blocks is None:
            blocks = self.req_to_blocks[request.request_id] = []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_tokens_after = num_computed + num_new_tokens
        target = max(num_tokens_after, reserve_up_to or 0)
        num_required = cdiv(target, self.block_size) - len(blocks) - len(new_computed_blocks)
        num_required = max(num_required, 0)
        # Hits sitting in the free queue stop being free once adopted.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        reserve = self.watermark_blocks if apply_watermark else 0
        if num_required + num_revived > self.pool.num_free_blocks - reserve:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return False
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        blocks.extend(self.pool.get_new_blocks(num_required))
        self._cache_full_blocks(request, min(num_tokens_after, request.num_tokens))
        return True

    def _allocate_grouped(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock],
        apply_watermark: bool, reserve_up_to: int | None,
    ) -> bool:
        """``allocate_slots`` over every group. A local group first releases what its window
        no longer reads (done even when the allocation then fails: the blocks are of no more
        use to this request) and does not reserve ahead: its blocks come and go with the
        window, so ``reserve_up_to`` is for the global groups."""
        rid = request.request_id
        bs = self.block_size
        num_hit = len(new_computed_blocks)
        tables = self._tables(rid)
        fresh = not tables[0] and all(not t for t in tables[1:])
        num_computed = request.num_computed_tokens + num_hit * bs
        num_tokens_after = num_computed + num_new_tokens
        released = self._released.setdefault(rid, [0] * len(tables))
        to_free: list[KVBlock] = []
        null = self.pool.null_block
        for g, window in enumerate(self.group_windows):
            if window is None:
                continue
            table = tables[g]
            first = min(first_needed_block(num_computed, window, bs), len(table))
            for i in range(released[g], first):
                to_free.append(table[i])
                assert null is not None
                table[i] = null
            released[g] = max(released[g], first)
        self.pool.free_blocks(to_free)
        hits: list[list[KVBlock]] = [list(new_computed_blocks)]
        hits += [self._group_hits(request, g, num_hit) for g in range(1, len(tables))]
        num_required = 0
        for g, window in enumerate(self.group_windows):
            target = num_tokens_after
            if window is None:
                target = max(target, reserve_up_to or 0)
            num_required += max(cdiv(target, bs) - len(tables[g]) - len(hits[g]), 0)
        num_revived = sum(1 for h in hits for b in h if b.ref_cnt == 0 and not b.is_null)
        reserve = self.watermark_blocks if apply_watermark else 0
        if num_required + num_revived > self.pool.num_free_blocks - reserve:
            if fresh:
                self._drop(rid)
            return False
        for g, window in enumerate(self.group_windows):
            self.pool.touch(hits[g])
            tables[g].extend(hits[g])
            if hits[g] and window is not None:
                released[g] = first_needed_block(num_computed, window, bs)
            target = num_tokens_after if window is not None else max(num_tokens_after,
                                                                      reserve_up_to or 0)
            tables[g].extend(self.pool.get_new_blocks(max(cdiv(target, bs) - len(tables[g]), 0)))
        self._cache_full_blocks(request, min(num_tokens_after, request.num_tokens))
        return True

    def _tables(self, request_id: str) -> list[list[KVBlock]]:
        """Every group's table of the request, created empty where it has none."""
        first = self.req_to_blocks.setdefault(request_id, [])
        rest = self.group_blocks.setdefault(
            request_id, [[] for _ in range(len(self.group_windows) - 1)])
        return [first, *rest]

    def _drop(self, request_id: str) -> None:
        self.req_to_blocks.pop(request_id, None)
        self.group_blocks.pop(request_id, None)
        self._released.pop(request_id, None)

    def _cache_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        if not self.enable_caching:
            return
        num_full = num_known_tokens // self.block_size
        start = self._req_num_cached.get(request.request_id, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request.request_id]
        hashes = self._block_hashes(request, num_full)
        # Each run of consecutive blocks new to the cache is one BlockStored, chained to the
        # block before it (as vLLM reports them); twins of cached blocks are not news.
        # (Events describe group 0's cache; the other groups' blocks are cached silently.)
        run: list[BlockHash] = []
        for i in range(start, num_full):
            if self.pool.cache_block(blocks[i], hashes[i]):
                run.append(hashes[i])
            elif run:
                self._record_stored(run)
                run = []
        if run:
            self._record_stored(run)
        for g, table in enumerate(self.group_blocks.get(request.request_id, ()), start=1):
            for i in range(start, num_full):
                self.pool.cache_block(table[i], hashes[i], g)
        self._req_num_cached[request.request_id] = num_full

    def _record_stored(self, run: list[BlockHash]) -> None:
        self.pool.record_event(BlockStored(
            block_hashes=tuple(h.value for h in run),
            parent_block_hash=run[0].parent,
            token_ids=tuple(t for h in run for t in h.token_ids),
            block_size=self.block_size,
        ))

    def take_events(self) -> list[KVCacheEvent]:
        """Prefix-cache events since the last call (``enable_kv_cache_events``), in order."""
        return self.pool.take_events()

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so the shared head is evicted last."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.pool.free_blocks(reversed(blocks))
        for table in self.group_blocks.pop(request.request_id, ()):
            self.pool.free_blocks(reversed(table))
        self._released.pop(request.request_id, None)
        self._req_num_cached.pop(request.request_id, None)
        if request.is_finished:
            self._req_hashes.pop(request.request_id, None)

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent (tests call this each step)."""
        refs: dict[int, int] = {}
        tables = [*self.req_to_blocks.values(),
                  *(t for ts in self.group_blocks.values() for t in ts)]
        for blocks in tables:
            for b in blocks:
                if not b.is_null:
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for rid, released in self._released.items():
            for g, table in enumerate(self._tables(rid)):
                if any(not b.is_null for b in table[: released[g]]) or any(
                        b.is_null for b in table[released[g]:]):
                    raise AssertionError(f"{rid} group {g}: released slots are not exactly "
                                         f"the first {released[g]}")
        free = set(self.pool.free_block_ids())
        if len(free) != len(self.pool.free_block_ids()):
            raise AssertionError("a block appears twice in the free queue")
        null = self.pool.null_block
        if null is not None and (null.ref_cnt or null.block_id in free or null.block_hash):
            raise AssertionError("the null block was allocated, freed or cached")
        for block in self.pool.blocks:
            if block.is_null:
                continue
            expected = refs.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise AssertionError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {expected} tables hold it"
                )
            if (block.block_id in free) != (expected == 0):
                raise AssertionError(
                    f"block {block.block_id}: free={block.block_id in free} with {expected} refs"
                )
        pool = self.pool
        bands = [0] * pool.num_bands
        for block_id in [*refs, *([] if null is None else [null.block_id])]:
            bands[block_id * pool.num_bands // pool.num_blocks] += 1
        if bands != pool.band_used:
            raise AssertionError(f"band_used {pool.band_used} but tables hold {bands}")
