"""Packs record_vllm_metrics.sh's pages into tests/fixtures/watch/: the idle page, the two
after the sequential requests, then every STRIDE-th page of the burst (about 12 s apart on
the 2-vCPU host: one watch window each), as [{"t": wall clock, "text": page}], gzipped.

    python benchmarks/peers/pack_watch_fixture.py OUT_DIR FIXTURE.json.gz [STRIDE]
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    stride = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    last = len(list(src.glob("[0-9][0-9][0-9].txt")))
    pick = [0, 1, 2, *range(2 + stride, last, stride)]
    pages = [{"t": float((src / f"{i:03d}.t").read_text()),
              "text": (src / f"{i:03d}.txt").read_text()} for i in pick]
    with gzip.open(dst, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(pages, f)
    print(f"{len(pages)} pages, {dst.stat().st_size} bytes -> {dst}")


if __name__ == "__main__":
    main()
