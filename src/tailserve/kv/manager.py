"""KVCacheManager: block tables per request, prefix-cache lookups and the admission watermark.

Torch-free and deterministic. A request's block table covers its computed tokens plus the
tokens scheduled this step::

    tokens:  |<- num_computed_tokens ->|<- num_new_tokens ->|
    blocks:  [b0][b1][b2]...                         [bk]  <- allocated up to here

Full blocks whose tokens are known are hashed (chained, see ``block_pool.hash_block``) and
registered in the pool as soon as they are scheduled, so a request admitted later in the same
step can already share them: K/V are written before attention reads them in every layer.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from tailserve.data.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent
from tailserve.data.records import KVCacheSnapshot
from tailserve.kv.block_pool import BlockHash, BlockPool, HashAlgo, KVBlock, hash_block
from tailserve.request import Request

_BLOCK_ID = operator.attrgetter("block_id")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
        enable_kv_cache_events: bool = False,
        hash_algo: HashAlgo = "sha256",
    ) -> None:
        self.block_size = block_size
        self.hash_algo: HashAlgo = hash_algo
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        # A subscriber that outlived an earlier engine at the same endpoint must forget what
        # that one held: the first event of every engine says the cache is empty.
        self.pool.record_event(AllBlocksCleared())
        # Free blocks that admitting a *new* request must leave, so running requests can grow.
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
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
        # map over attrgetter: ~2x a list comprehension, once per scheduled request per step.
        return list(map(_BLOCK_ID, self.req_to_blocks.get(request_id, ())))

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
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(request, max_hit_blocks):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

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
        run: list[BlockHash] = []
        for i in range(start, num_full):
            if self.pool.cache_block(blocks[i], hashes[i]):
                run.append(hashes[i])
            elif run:
                self._record_stored(run)
                run = []
        if run:
            self._record_stored(run)
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
        self._req_num_cached.pop(request.request_id, None)
        if request.is_finished:
            self._req_hashes.pop(request.request_id, None)

    def check_invariants(self) -> None:
        """Raise AssertionError if block accounting is inconsistent (tests call this each step)."""
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        free = set(self.pool.free_block_ids())
        if len(free) != len(self.pool.free_block_ids()):
            raise AssertionError("a block appears twice in the free queue")
        for block in self.pool.blocks:
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
        for block_id in refs:
            bands[block_id * pool.num_bands // pool.num_blocks] += 1
        if bands != pool.band_used:
            raise AssertionError(f"band_used {pool.band_used} but tables hold {bands}")
