"""Sliding-window KV that saves memory (issue 32, item 3): the KV cache groups' layout and the
block manager's per-group tables, exact block ids, releases and prefix hits. No torch."""

from __future__ import annotations

import pytest

from tailserve.kv.manager import KVCacheManager
from tailserve.kv_groups import (
    blocks_per_seq,
    kv_group_layout,
    max_blocks_per_seq,
    single_group,
)
from tailserve.request import Request, RequestStatus
from tailserve.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def finish(kv: KVCacheManager, r: Request) -> None:
    r.status = RequestStatus.FINISHED_STOPPED
    kv.free(r)
    kv.check_invariants()


def test_layouts() -> None:
    w = 512
    gemma_270m = [None if (i + 1) % 6 == 0 else w for i in range(18)]  # 3 global, 15 local
    lay = kv_group_layout(gemma_270m, 32768)
    assert lay.group_windows == (None, w, w, w, w, w)
    assert lay.layers_per_block == 3
    assert lay.layer_group[:7] == (1, 1, 1, 2, 2, 0, 2)
    assert lay.layer_slot[:7] == (0, 1, 2, 0, 1, 0, 2)
    assert lay.layer_group[17] == 0 and lay.layer_slot[17] == 2
    # Gemma 3 1B: 4 global, 22 local: pages of 4 layers, the last local group padded
    gemma_1b = [None if (i + 1) % 6 == 0 else w for i in range(26)]
    lay = kv_group_layout(gemma_1b, 32768)
    assert (lay.group_windows, lay.layers_per_block) == ((None,) + (w,) * 6, 4)
    # every (group, slot) holds one layer
    places = list(zip(lay.layer_group, lay.layer_slot, strict=True))
    assert len(set(places)) == 26
    # Mistral: every layer slides, one group
    assert kv_group_layout([w] * 4, 32768).group_windows == (w,)
    assert kv_group_layout([w] * 4, 32768).layers_per_block == 4
    # A window that never binds, release off, no window: one global group, as before
    assert kv_group_layout([w] * 4, w) == single_group(4)
    assert kv_group_layout(gemma_270m, 32768, release=False) == single_group(18)
    assert kv_group_layout([None] * 4, 32768) == single_group(4)


def test_blocks_per_seq() -> None:
    # 4 x the window: a global group 64 blocks, a local one the window's 16 + 1
    assert blocks_per_seq((None,), 1024, 16) == 64
    assert blocks_per_seq((256,), 1024, 16) == 17
    assert blocks_per_seq((None, 256, 256), 1024, 16) == 64 + 17 + 17
    # shorter than the window: every block
    assert blocks_per_seq((None, 256), 100, 16) == 7 + 7
    # a 128-token chunk past the window holds the window and the chunk
    assert max_blocks_per_seq((256,), 1024, 16, 128) == 16 + 8 + 1


def test_a_local_group_releases_what_its_window_passed() -> None:
    """Mistral-like (one group, window 8, blocks of 4): chunks of 8 then decodes; block 0
    is the null block."""
    kv = KVCacheManager(num_blocks=10, block_size=4, group_windows=(8,))
    assert kv.pool.num_free_blocks == 9
    a = req("a", list(range(20)))
    assert kv.allocate_slots(a, 8)
    assert kv.block_ids("a") == [1, 2]
    a.num_computed_tokens = 8
    # the next token (8) reads 1 .. 8: nothing released
    assert kv.allocate_slots(a, 8)
    assert kv.block_ids("a") == [1, 2, 3, 4]
    a.num_computed_tokens = 16
    # token 16 reads 9 .. 16: blocks 0 and 1 (positions 0 .. 7) are released
    assert kv.allocate_slots(a, 4)
    assert kv.block_ids("a") == [0, 0, 3, 4, 5]
    assert kv.num_blocks_held("a") == 3
    assert kv.pool.num_free_blocks == 6
    kv.check_invariants()
    a.num_computed_tokens = 20
    a.append_output_token(7)
    assert kv.allocate_slots(a, 1)  # token 20 reads 13 ..: block 2 goes, block 5 is new
    assert kv.block_ids("a") == [0, 0, 0, 4, 5, 6]
    # released blocks are evicted oldest first, after the never-used ones
    assert kv.pool.free_block_ids() == [7, 8, 9, 1, 2, 3]
    assert kv.num_blocks_held("a") == blocks_per_seq((8,), 21, 4) == 3
    kv.check_invariants()
    finish(kv, a)
    assert kv.pool.num_free_blocks == 9


def test_global_and_local_groups() -> None:
    """Gemma-like (a global and a local group): the global table grows, the local one
    slides; a sequence 4 x the window holds 16 + 3 blocks where two global groups hold 32."""
    kv = KVCacheManager(num_blocks=40, block_size=4, group_windows=(None, 16))
    a = req("a", list(range(64)), max_tokens=1)
    for start in range(0, 64, 16):
        a.num_computed_tokens = start
        assert kv.allocate_slots(a, 16)
        kv.check_invariants()
    # each chunk takes 4 global blocks, then 4 local ones, after the local group released
    # what the chunk's first token no longer reads (chunk 32 ..: from 17, block 4 on)
    assert kv.block_ids("a") == [1, 2, 3, 4, 9, 10, 11, 12, 17, 18, 19, 20, 25, 26, 27, 28]
    assert kv.group_block_ids("a") == ([0] * 8 + [21, 22, 23, 24, 29, 30, 31, 32],)
    assert kv.num_blocks_held("a") == 16 + 8 <= max_blocks_per_seq((None, 16), 64, 4, 16)
    a.num_computed_tokens = 64
    a.append_output_token(1)
    assert kv.allocate_slots(a, 1)
    # token 64 reads 49 .. 64: the local group keeps blocks 12 .. 16
    assert kv.block_ids("a")[16:] == [33]
    assert kv.group_block_ids("a") == ([0] * 12 + [29, 30, 31, 32, 34],)
    assert kv.num_blocks_held("a") == 17 + 5 == blocks_per_seq((None, 16), 65, 4)
    kv.check_invariants()
    finish(kv, a)
    assert kv.pool.num_free_blocks == 39


def test_a_prefix_hit_needs_every_group() -> None:
    """A hit is claimed only as far as the local group still caches the window before it:
    once the blocks ``a`` released early are evicted, the global group's 3 cached blocks are
    no hit at all."""
    def run_a(kv: KVCacheManager) -> None:
        a = req("a", list(range(24)))
        for start in (0, 8, 16):
            a.num_computed_tokens = start
            assert kv.allocate_slots(a, 8)
        # global 1, 2 | 5, 6 | 9, 10; local 3, 4 | 7, 8 | 11, 12 after 3 and 4 were released
        assert kv.group_block_ids("a") == ([0, 0, 7, 8, 11, 12],)
        finish(kv, a)

    b_tokens = [*range(14), 99, 98]
    kv = KVCacheManager(num_blocks=16, block_size=4, group_windows=(None, 8))
    run_a(kv)
    b = req("b", b_tokens)
    hits, n = kv.get_computed_blocks(b)
    assert (n, [h.block_id for h in hits]) == (12, [1, 2, 5])
    assert kv.allocate_slots(b, 4, hits)
    # the local group adopted the window before token 12 (blocks 1, 2: ids 4, 7, the first
    # released early), slot 0 is null; one new block in each group
    assert kv.block_ids("b") == [1, 2, 5, 13]
    assert kv.group_block_ids("b") == ([0, 4, 7, 14],)
    kv.check_invariants()
    finish(kv, b)

    kv = KVCacheManager(num_blocks=16, block_size=4, group_windows=(None, 8))
    run_a(kv)
    # a's local blocks 0 .. 2 were released first, so they are the first evicted
    c = req("c", [500 + i for i in range(12)])
    assert kv.allocate_slots(c, 12)  # 3 global + 3 local blocks: evicts them
    b = req("b", b_tokens)
    global_hits = [kv.pool.lookup(h) for h in kv._block_hashes(b, 3)]
    assert all(h is not None for h in global_hits)
    assert kv.get_computed_blocks(b) == ([], 0)
    kv.check_invariants()


def test_a_failed_allocation_leaves_no_table() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=4, group_windows=(None, 8))
    a = req("a", list(range(8)))
    assert kv.allocate_slots(a, 8)  # 2 + 2 of 4 usable blocks
    b = req("b", list(range(100, 108)))
    assert not kv.allocate_slots(b, 8)
    assert "b" not in kv.req_to_blocks and "b" not in kv.group_blocks
    kv.check_invariants()


@pytest.mark.parametrize("windows", [(None,), (8,), (None, 8), (None, 8, 8)])
def test_random_traffic_keeps_the_books(windows: tuple[int | None, ...]) -> None:
    """Many requests sharing prefixes, chunked, preempted and finished: the invariants hold
    after every operation and the pool is whole at the end."""
    import random
    rng = random.Random(5)
    kv = KVCacheManager(num_blocks=60, block_size=4, group_windows=windows)
    running: list[Request] = []
    base = [rng.randrange(50) for _ in range(40)]
    for i in range(200):
        if len(running) < 4:
            r = req(f"r{i}", base[: rng.randrange(5, 40)] + [rng.randrange(50)
                                                            for _ in range(rng.randrange(1, 9))],
                    max_tokens=20)
            hits, n = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, min(8, r.num_tokens - n), hits):
                r.num_computed_tokens = n + min(8, r.num_tokens - n)
                running.append(r)
        for r in list(running):
            left = r.num_tokens - r.num_computed_tokens
            step = min(left, 8) if left else 1
            if not left:
                r.append_output_token(rng.randrange(50))
                step = 1
            if not kv.allocate_slots(r, step):
                r.num_computed_tokens = 0
                kv.free(r)  # preempted (recompute)
                running.remove(r)
            else:
                r.num_computed_tokens += step
                if r.num_output_tokens >= 12:
                    finish(kv, r)
                    running.remove(r)
            kv.check_invariants()
    for r in running:
        finish(kv, r)
    assert kv.pool.num_free_blocks == 60 - (1 if windows != (None,) else 0)
