"""Packs diagnose_scenarios.py's results into tests/fixtures/diagnose/ (gzipped): floats to 7
significant digits (wall-clock times, >= 1e6, to 0.1 ms), local paths in the bench's argv cut
to their file names; each vLLM scenario's request spans as ``NAME-spans.jsonl.gz``, as the
harness's collector wrote them.

    python benchmarks/peers/pack_diagnose_fixtures.py OUT_DIR tests/fixtures/diagnose NAME...
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from pathlib import Path
from typing import Any


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4) if abs(x) >= 1e6 else float(f"{x:.7g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


def pack(src: Path, dst: Path, name: str) -> None:
    result = _round(json.loads((src / f"{name}.json").read_text(encoding="utf-8")))
    env = (result.get("tailserve") or {}).get("environment") or {}
    if isinstance(env.get("argv"), list):
        env["argv"] = [os.path.basename(a) if os.sep in a else a for a in env["argv"]]
    out = dst / f"{name}.json.gz"
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        json.dump(result, f, separators=(",", ":"))
    print(f"{out}: {out.stat().st_size} bytes")
    spans = src / f"{name}-spans.jsonl"
    if spans.exists():
        out = dst / f"{name}-spans.jsonl.gz"
        with gzip.open(out, "wb", compresslevel=9) as f:
            f.write(spans.read_bytes())
        print(f"{out}: {out.stat().st_size} bytes")


def main() -> None:
    src, dst = Path(sys.argv[1]), Path(sys.argv[2])
    for name in sys.argv[3:]:
        pack(src, dst, name)


if __name__ == "__main__":
    main()
