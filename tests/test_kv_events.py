"""KV-cache events: a real ZMQ subscriber rebuilds the engine's prefix cache from them.

The subscriber decodes the payloads with plain msgpack (no tailserve type), as a router in
another language would, so the test pins the wire format (three frames, dense big-endian
sequence numbers, ``[ts, events, rank]`` batches of ``"type"``-tagged maps) and not our own
structs. The block hashes are recomputed from the events' token ids with the recipe the docs
give (docs/wire.md, "KV-cache events"), so the documentation is tested too.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import xxhash
import zmq

from tailserve import LLM, SamplingParams
from tailserve.config import KVEventsConfig
from tailserve.errors import ConfigError
from tailserve.kv.manager import KVCacheManager
from tailserve.request import Request, RequestStatus

BLOCK_SIZE = 4
REPLAY_END = (-1).to_bytes(8, "big", signed=True)


def documented_digest(parent: bytes | None, token_ids: list[int]) -> bytes:
    """The docs' recipe (the default, sha256): SHA-256 of the parent block's digest (b"root"
    for a first block of an unsalted request), then each token id as 4 little-endian signed
    bytes; the event's 64-bit hash is the digest's first 8 bytes, little-endian."""
    head = b"root" if parent is None else parent
    return hashlib.sha256(head + b"".join(t.to_bytes(4, "little", signed=True)
                                          for t in token_ids)).digest()


def documented_xxh64(parent: int | None, token_ids: list[int]) -> int:
    """The xxh64 recipe (``--prefix-caching-hash-algo xxh64``): xxh64 (seed 0) of the parent's
    8 little-endian bytes (b"root" for a first block), then the token ids as above."""
    h = xxhash.xxh64()
    h.update(b"root" if parent is None else parent.to_bytes(8, "little"))
    for t in token_ids:
        h.update(t.to_bytes(4, "little", signed=True))
    return h.intdigest()


def event_value(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little")


class Mirror:
    """What a router knows: the set of hashes the events say are cached."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.kinds: list[str] = []
        # A router recomputing hashes from tokens chains digests: it remembers each block's.
        self.digests: dict[int, bytes] = {}

    def apply(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and rank == 0
        for e in events:
            self.kinds.append(e["type"])
            if e["type"] == "BlockStored":
                assert e["block_size"] == BLOCK_SIZE and e["medium"] == "GPU"
                assert e["lora_id"] is None and e["lora_name"] is None
                hashes, tokens = e["block_hashes"], e["token_ids"]
                assert len(tokens) == BLOCK_SIZE * len(hashes)
                parent = e["parent_block_hash"]
                for i, h in enumerate(hashes):
                    digest = documented_digest(None if parent is None else self.digests[parent],
                                               tokens[i * BLOCK_SIZE:][:BLOCK_SIZE])
                    assert h == event_value(digest)
                    self.digests[h] = digest
                    parent = h
                self.cached.update(hashes)
            elif e["type"] == "BlockRemoved":
                assert set(e["block_hashes"]) <= self.cached, "removed a hash never stored"
                self.cached.difference_update(e["block_hashes"])
            else:
                assert e == {"type": "AllBlocksCleared"}
                self.cached.clear()


@pytest.mark.parametrize("algo,group_windows,num_blocks", [
    ("sha256", (None,), 10), ("xxh64", (None,), 10),
    # KV cache groups: the events describe group 0's cache alone (the other group's blocks
    # are cached and evicted silently), and still add up to it
    ("sha256", (None, 4), 20),
])
def test_manager_events_replay_to_the_cached_hashes(
        algo: str, group_windows: tuple[int | None, ...], num_blocks: int) -> None:
    """Torch-free: after every allocation the events so far add up to the pool's map."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_kv_cache_events=True,
                        hash_algo=algo, group_windows=group_windows)  # type: ignore[arg-type]
    digests: dict[int, bytes] = {}
    cached: set[int] = set()
    g = torch.Generator().manual_seed(3)
    head = torch.randint(0, 1000, (8,), generator=g).tolist()
    removed = 0
    for i in range(12):
        tokens = head + torch.randint(0, 1000, (4 + 3 * (i % 4),), generator=g).tolist()
        r = Request(f"r{i}", tokens, SamplingParams(max_tokens=1))
        hits, _ = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, len(tokens) - len(hits) * 4, hits)
        for e in kv.take_events():
            cached = _apply_plain(cached, e, 4, algo, digests)
            removed += type(e).__name__ == "BlockRemoved"
        assert cached == kv.pool.cached_block_hashes()
        r.status = RequestStatus.FINISHED_STOPPED
        kv.free(r)
        kv.check_invariants()
    assert removed > 0  # the pool of 10 blocks evicted along the way


def _apply_plain(cached: set[int], e: Any, block_size: int, algo: str,
                 digests: dict[int, bytes]) -> set[int]:
    name = type(e).__name__
    if name == "BlockStored":
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            tokens = list(e.token_ids[i * block_size:][:block_size])
            if algo == "xxh64":
                assert h == documented_xxh64(parent, tokens)
            else:
                digest = documented_digest(None if parent is None else digests[parent], tokens)
                assert h == event_value(digest)
                digests[h] = digest
            parent = h
        return cached | set(e.block_hashes)
    if name == "BlockRemoved":
        return cached - set(e.block_hashes)
    return set()


def test_events_are_off_by_default() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = Request("a", list(range(9)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(r, 9)
    assert kv.take_events() == []


def test_kv_events_config_parses_like_vllm() -> None:
    cfg = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv-events"}')
    assert cfg is not None and cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557"
    assert cfg.enabled
    off = KVEventsConfig.parse({"enable_kv_cache_events": False})
    assert off is not None and off.publisher == "null" and not off.enabled
    with pytest.raises(ConfigError, match=r"kv_events_config: unknown field\(s\) topik; known: "):
        KVEventsConfig.parse('{"topik": "x"}')
    with pytest.raises(ConfigError, match="kv_events_config: not JSON"):
        KVEventsConfig.parse("{enable")
    with pytest.raises(ConfigError, match=r"kv_events_config: not a JSON object \(an array\)"):
        KVEventsConfig.parse("[1]")
    with pytest.raises(ConfigError, match="publisher must be 'null' or 'zmq', got 'kafka'"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})


def test_subscriber_rebuilds_the_prefix_cache(default_loaded: Any, tmp_path: Path) -> None:
    pub_addr, replay_addr = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    llm = LLM.from_loaded(
        default_loaded, dtype="float32", num_kv_blocks=16, max_model_len=64,
        block_size=BLOCK_SIZE, enforce_eager=True,
        kv_events_config={"enable_kv_cache_events": True, "endpoint": pub_addr,
                          "replay_endpoint": replay_addr, "topic": "kv-events"},
    )
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.connect(pub_addr)
    # A DEALER, not vLLM's example REQ: a REQ takes only the first of the replies.
    replay = ctx.socket(zmq.DEALER)
    replay.connect(replay_addr)
    try:
        g = torch.Generator().manual_seed(11)
        heads = [torch.randint(20, 49152, (8,), generator=g).tolist() for _ in range(2)]
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        # 2 heads x 3 tails of 6-14 tokens (4-6 blocks each) through a 16-block pool: hits on
        # the shared heads, and evictions.
        prompts = [{"prompt_token_ids": h + torch.randint(20, 49152, (6 + 4 * k,), generator=g)
                    .tolist()} for h in heads for k in range(3)]
        outs = llm.generate(prompts, params)
        assert any(o.num_cached_tokens >= 8 for o in outs)
        # A late joiner misses the first batches (the PUB drops them before the subscription
        # arrives); the replay socket resends them, as vLLM's subscribers expect.
        mirror = Mirror()
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        next_seq = 0
        while True:
            assert replay.poll(10_000), "the replay did not answer"
            empty, seq_bytes, payload = replay.recv_multipart()
            assert empty == b""
            if seq_bytes == REPLAY_END:
                assert payload == b""
                break
            assert int.from_bytes(seq_bytes, "big") == next_seq
            mirror.apply(payload)
            next_seq += 1
        pool = llm.engine.scheduler.kv.pool
        assert next_seq == llm.engine.kv_events.next_seq
        assert mirror.kinds[0] == "AllBlocksCleared"
        assert "BlockRemoved" in mirror.kinds
        assert mirror.cached == pool.cached_block_hashes()
        # Live on PUB from here (the subscription has long arrived): the same dense sequence.
        more = [{"prompt_token_ids": heads[0] + torch.randint(20, 49152, (10,), generator=g)
                 .tolist()} for _ in range(2)]
        llm.generate(more, params)
        _drain_live(sub, mirror, next_seq, llm.engine.kv_events.next_seq)
        assert mirror.cached == pool.cached_block_hashes()
    finally:
        sub.close(linger=0)
        replay.close(linger=0)
        ctx.term()
        llm.engine.close()


def _drain_live(sub: zmq.Socket, mirror: Mirror, next_seq: int, end: int) -> None:
    """Skip what PUB delivered before ``next_seq`` (already replayed), apply up to ``end``."""
    while next_seq < end:
        assert sub.poll(10_000), f"batch {next_seq} of {end} never arrived"
        _, seq_bytes, payload = sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if seq < next_seq:
            continue
        assert seq == next_seq, f"gap: got {seq}, expected {next_seq}"
        mirror.apply(payload)
        next_seq += 1


def test_bad_endpoint_is_a_config_error(default_loaded: Any) -> None:
    with pytest.raises(ConfigError, match="kv_events_config: cannot open 'tcp://\\*:notaport'"):
        LLM.from_loaded(default_loaded, dtype="float32", num_kv_blocks=24, max_model_len=256,
                        kv_events_config={"enable_kv_cache_events": True,
                                          "endpoint": "tcp://*:notaport"})
