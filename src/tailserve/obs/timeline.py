"""The timeline: one record per engine step and one per finished request, in one time order.

It is the raw material of ``tailserve diagnose``: request lengths, queue times, KV and memory
watermarks and TTFTs land in the same time window, so a P99 spike can be joined with what the
engine was doing at that moment.

Records live in a bounded ring (``GET /debug/timeline?since=T``) and, with ``--timeline PATH``,
are appended to a JSONL file as they come (one JSON object per line, flushed each time, so a
crash loses at most the record being written and ``tail -f`` works).

Not thread-safe: the API process feeds it from its one asyncio thread.
"""

from __future__ import annotations

import json
from collections import deque
from typing import IO, Any

from tailserve.data.records import RequestRecord
from tailserve.data.step import StepStats

Record = dict[str, Any]
# Records kept in the ring unless told otherwise (``serve --timeline-buffer``'s default).
DEFAULT_MAXLEN = 20000


class Timeline:
    """Bounded, time-ordered record store with an optional JSONL append file.

    Invariant: the ring is sorted by ``record["t"]`` (wall clock). Step records (stamped in the
    engine process) and request records (stamped at finish in the API process) can arrive a
    little out of order; such a record is inserted at its place, which is near the end, so
    ``since`` can walk back from the newest record and stop at the first one at or before T.
    """

    def __init__(self, path: str | None = None, maxlen: int = DEFAULT_MAXLEN) -> None:
        if maxlen < 1:
            raise ValueError(f"timeline maxlen must be at least 1, got {maxlen}")
        self.path = path
        self._ring: deque[Record] = deque(maxlen=maxlen)
        # Line-buffered append: several runs can share a file and each line is complete.
        self._file: IO[str] | None = (
            open(path, "a", buffering=1, encoding="utf-8") if path is not None else None  # noqa: SIM115
        )

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def maxlen(self) -> int:
        maxlen = self._ring.maxlen
        assert maxlen is not None  # set in __init__
        return maxlen

    def add_step(self, stats: StepStats) -> Record:
        return self._add({"kind": "step", **stats.as_dict()})

    def add_request(self, rec: RequestRecord) -> Record:
        row = {"kind": "request", **vars(rec)}
        # Not the gaps (one per streamed batch: a long stream's row would be mostly these);
        # metrics and the dashboard take them from the record itself.
        del row["itl_s"]
        return self._add(row)

    def since(self, t: float | None, limit: int | None = None) -> list[Record]:
        """Records with ``record["t"] > t`` (all when ``t`` is None), oldest first.

        With ``limit``, the newest ``limit`` of them: a live view that fell behind wants the
        present, and the full history is in the JSONL file. The dicts are the stored ones;
        callers must not mutate them.
        """
        if limit is not None and limit <= 0:
            return []
        out: list[Record] = []
        for record in reversed(self._ring):
            if (t is not None and record["t"] <= t) or (limit is not None and len(out) >= limit):
                break
            out.append(record)
        out.reverse()
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _add(self, record: Record) -> Record:
        ring, t = self._ring, record["t"]
        if not ring or ring[-1]["t"] <= t:
            ring.append(record)
        else:
            self._insert_sorted(record, t)
        if self._file is not None:
            # default=str: a stray enum or path in a record must not kill the serving loop.
            self._file.write(json.dumps(record, default=str) + "\n")
        return record

    def _insert_sorted(self, record: Record, t: float) -> None:
        ring = self._ring
        # Walk back to the last record at or before t (few steps: records are late by
        # milliseconds). Inserting after it keeps equal times in arrival order.
        i = len(ring)
        while i > 0 and ring[i - 1]["t"] > t:
            i -= 1
        if len(ring) == ring.maxlen:
            if i == 0:
                return  # older than everything the full ring still holds: it would be evicted
            # deque.insert refuses on a full ring; make room by dropping the oldest record.
            ring.popleft()
            i -= 1
        ring.insert(i, record)
