"""Block pool and KV cache manager: exact block ids, reference counts, LRU eviction."""

from __future__ import annotations

import pytest

from tailserve.kv import block_pool
from tailserve.kv.block_pool import BlockHash, BlockPool, hash_block
from tailserve.kv.manager import KVCacheManager
from tailserve.request import Request, RequestStatus
from tailserve.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def test_allocate_and_free_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2)  # 12 tokens still fit 3 blocks
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.allocate_slots(a, 3)
    assert kv.block_ids("a") == [0, 1, 2, 3]
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    # Tail first: block 3 is evicted before the head blocks a shared prefix would use.
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    kv.check_invariants()


def test_allocation_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    a = req("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    b = req("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)
    assert kv.snapshot().num_free_blocks == 1
    assert "b" not in kv.req_to_blocks
    kv.check_invariants()


def test_watermark_applies_only_when_asked() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False, watermark=0.2)
    assert kv.watermark_blocks == 2
    a = req("a", list(range(28)))
    # 7 blocks leave 3 free >= 2: admitted.
    assert kv.allocate_slots(a, 28, apply_watermark=True)
    b = req("b", list(range(8)))
    # 2 more blocks would leave 1 < 2: a new admission is refused ...
    assert not kv.allocate_slots(b, 8, apply_watermark=True)
    # ... but a running request may grow into the watermark.
    a.num_computed_tokens = 28
    assert kv.allocate_slots(a, 8)
    assert kv.snapshot().num_free_blocks == 1


def test_prefix_cache_hit_shares_blocks_with_refcounts() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    a = req("a", [*shared, 1, 2])
    hits, n = kv.get_computed_blocks(a)
    assert (hits, n) == ([], 0)
    assert kv.allocate_slots(a, 10)
    assert kv.block_ids("a") == [0, 1, 2]
    b = req("b", [*shared, 3])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    assert kv.allocate_slots(b, 1, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.check_invariants()


def test_prefix_hit_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    b = req("b", list(range(8)))
    _, n = kv.get_computed_blocks(b)
    assert n == 4  # the last block is recomputed so the step has logits to sample from


def test_freed_blocks_stay_cached_then_evict_lru() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    assert kv.block_ids("a") == [0, 1, 2]
    a.status = RequestStatus.FINISHED_STOPPED
    kv.free(a)
    assert kv.pool.free_block_ids() == [3, 2, 1, 0]
    # A later request with the same prefix revives blocks 0 and 1 from the free queue.
    b = req("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 4
    assert kv.allocate_slots(b, 1, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.free_block_ids() == [2]
    b.status = RequestStatus.FINISHED_STOPPED
    kv.free(b)
    # A new prefix takes the least recently freed block first: 2 (a's old tail) goes.
    c = req("c", [5, 5, 5])
    assert kv.allocate_slots(c, 3)
    assert kv.block_ids("c") == [2, 3]
    d = req("d", [1, 2, 3, 4, 0])
    hits, _ = kv.get_computed_blocks(d)
    assert [h.block_id for h in hits] == [0, 1]
    kv.check_invariants()


def test_hash_collision_is_guarded_by_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    def constant_hash(parent: BlockHash | None, token_ids: list[int], **_: object) -> BlockHash:
        return BlockHash(b"42", 42, parent.value if parent else None, tuple(token_ids))

    monkeypatch.setattr("tailserve.kv.manager.hash_block", constant_hash)
    kv = KVCacheManager(num_blocks=8, block_size=2)
    a = req("a", [1, 2, 3])
    assert kv.allocate_slots(a, 3)
    b = req("b", [9, 9, 3])
    hits, n = kv.get_computed_blocks(b)
    assert hits == [] and n == 0  # same 64-bit key, different tokens: a miss, not a wrong hit


def test_hash_chain_depends_on_parent() -> None:
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]).value != hash_block(None, [3, 4]).value
    assert hash_block(None, [1, 2]) == h1
    assert block_pool.hash_block(None, [2, 1]).value != h1.value


def test_sha256_is_the_default_and_commits_to_the_chain() -> None:
    import hashlib
    import struct

    h1 = hash_block(None, [1, 2])
    assert h1.digest == hashlib.sha256(b"root" + struct.pack("<2i", 1, 2)).digest()
    assert h1.value == int.from_bytes(h1.digest[:8], "little") and h1.parent is None
    h2 = hash_block(h1, [3, 4])
    assert h2.digest == hashlib.sha256(h1.digest + struct.pack("<2i", 3, 4)).digest()
    assert h2.parent == h1.value


def test_xxh64_keeps_the_documented_unsalted_recipe() -> None:
    import xxhash

    h1 = hash_block(None, [1, 2], algo="xxh64")
    assert h1.value == xxhash.xxh64(b"root" + (1).to_bytes(4, "little")
                                    + (2).to_bytes(4, "little")).intdigest()
    h2 = hash_block(h1, [3, 4], algo="xxh64")
    assert h2.value == xxhash.xxh64(h1.value.to_bytes(8, "little") + (3).to_bytes(4, "little")
                                    + (4).to_bytes(4, "little")).intdigest()


@pytest.mark.parametrize("algo", ["sha256", "xxh64"])
def test_salted_chains_differ_from_the_first_block_on(algo: block_pool.HashAlgo) -> None:
    plain = hash_block(None, [1, 2], algo=algo)
    a = hash_block(None, [1, 2], salt="tenant-a", algo=algo)
    assert len({plain.digest, a.digest, hash_block(None, [1, 2], salt="tenant-b",
                                                  algo=algo).digest}) == 3
    assert a == hash_block(None, [1, 2], salt="tenant-a", algo=algo)
    # Later blocks inherit the salt through the chain; a salt on them is not read.
    assert hash_block(a, [3, 4], algo=algo) == hash_block(a, [3, 4], salt="x", algo=algo)
    assert hash_block(a, [3, 4], algo=algo).digest != hash_block(plain, [3, 4], algo=algo).digest
    # The empty salt is a salt too, not "no salt".
    assert hash_block(None, [1, 2], salt="", algo=algo).digest != plain.digest


@pytest.mark.parametrize("algo", ["sha256", "xxh64"])
def test_requests_share_cached_blocks_only_with_the_same_salt(algo: block_pool.HashAlgo) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=2, hash_algo=algo)
    prompt = [5, 6, 7, 8, 9]
    a = Request("a", prompt, SamplingParams(max_tokens=4), cache_salt="tenant-a")
    assert kv.allocate_slots(a, len(prompt))
    other = Request("b", prompt, SamplingParams(max_tokens=4), cache_salt="tenant-b")
    unsalted = Request("c", prompt, SamplingParams(max_tokens=4))
    same = Request("d", prompt, SamplingParams(max_tokens=4), cache_salt="tenant-a")
    assert kv.get_computed_blocks(other) == ([], 0)
    assert kv.get_computed_blocks(unsalted) == ([], 0)
    hits, n = kv.get_computed_blocks(same)
    assert n == 4 and [b.block_id for b in hits] == kv.block_ids("a")[:2]


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(blocks)


def test_reserve_allocates_the_whole_budget_up_front() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    a = req("a", list(range(5)), max_tokens=10)
    assert kv.allocate_slots(a, 5, reserve_up_to=15)
    assert kv.block_ids("a") == [0, 1, 2, 3]


def test_decodes_inside_held_blocks_cache_each_block_as_it_fills() -> None:
    # The steady decode (one token that fits the blocks held) skips the pool: it succeeds
    # with no block free, and the block it completes is cached at the token that fills it.
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", [5, 6, 7, 8, 9, 10])
    assert kv.allocate_slots(a, 6)
    assert kv.block_ids("a") == [0, 1]
    other = req("x", [1, 2, 3, 4])
    assert kv.allocate_slots(other, 4)  # the last free block
    assert kv.pool.num_free_blocks == 0
    a.num_computed_tokens = 6
    for token, cached in ((11, False), (12, True)):
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert kv.block_ids("a") == [0, 1]
        probe = req("p", [5, 6, 7, 8, 9, 10, 11, 12, 0])
        hits, n = kv.get_computed_blocks(probe)
        assert [h.block_id for h in hits] == ([0, 1] if cached else [0]) and n == len(hits) * 4
    assert not kv.allocate_slots(a, 1)  # the next token needs a block the pool lacks
    kv.check_invariants()
