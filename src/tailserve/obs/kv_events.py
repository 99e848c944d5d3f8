"""Prefix-cache events on ZMQ in vLLM's wire format, for KV-aware routers.

Each engine step's events (``data.kv_events``) go out as one batch, one ZMQ PUB message of
three frames::

    [topic (utf-8), sequence number (8 bytes, big-endian, from 0), payload (msgpack)]

The payload is the batch as a msgpack array ``[ts, events, data_parallel_rank]`` where each
event is a msgpack map tagged by ``"type"`` (vLLM's encoding since its map-encoded events),
e.g. ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids":
[...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None, ...}``.

With a ``replay_endpoint`` a ROUTER socket resends what a subscriber missed: a REQ sends the
first sequence number it wants (8 bytes, big-endian) and gets ``[seq, payload]`` for every
buffered batch from there, then ``[-1 (8 bytes, signed), b""]``.

The PUB socket is used only by the engine loop's thread (sending never blocks: past the
high-water mark ZMQ drops); the replay socket only by its own thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from tailserve.data import kv_events as ev

logger = logging.getLogger(__name__)

# vLLM's name for the tier that attention reads from (its "GPU"); routers rank other media
# (host, disk) below it. tailserve's pool is that tier on every device, CPU included.
MEDIUM = "GPU"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    """A map on the wire, its class name under ``"type"``."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_Event):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def to_wire(event: ev.KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """One engine event as vLLM spells it (one KV cache group, full attention, no LoRA)."""
    if isinstance(event, ev.BlockStored):
        return BlockStored(
            list(event.block_hashes), event.parent_block_hash, list(event.token_ids),
            event.block_size, lora_id=None, medium=MEDIUM, lora_name=None, group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    if isinstance(event, ev.BlockRemoved):
        return BlockRemoved(list(event.block_hashes), MEDIUM, group_idx=0)
    return AllBlocksCleared()


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and local transports are bound, anything else connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    """Publishes batches on ``endpoint``; serves replays on ``replay_endpoint`` if given."""

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._lock = threading.Lock()  # guards _buffer between the loop and the replay thread
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._closed = threading.Event()
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.bind(replay_endpoint)
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(replay,), name="kv-events-replay", daemon=True
            )
            self._replay_thread.start()

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: Sequence[ev.KVCacheEvent], ts: float | None = None) -> None:
        """Send one batch (nothing when ``events`` is empty: sequence numbers stay dense)."""
        if not events:
            return
        batch = KVEventBatch(
            time.time() if ts is None else ts, [to_wire(e) for e in events], self._rank
        )
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        with self._lock:
            self._buffer.append((seq, payload))

    def _serve_replay(self, sock: zmq.Socket) -> None:
        try:
            while not self._closed.is_set():
                if not sock.poll(100):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 3:  # [identity, b"", start seq] from a REQ
                    logger.warning("kv events replay: ignoring a %d-frame request", len(frames))
                    continue
                identity, _, start = frames
                first = int.from_bytes(start, "big")
                with self._lock:
                    wanted = [(s, p) for s, p in self._buffer if s >= first]
                for seq, payload in wanted:
                    sock.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
                sock.send_multipart((identity, b"", END_OF_REPLAY, b""))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._closed.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2.0)
        self._pub.close(linger=0)
        self._ctx.term()
