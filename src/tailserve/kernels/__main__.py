"""``python -m tailserve.kernels``: build the CPU kernels now (``make setup`` runs this)."""

from __future__ import annotations

import sys
import time

from tailserve.kernels import _build_dir, cpu_ops_available


def main() -> int:
    start = time.perf_counter()
    ok = cpu_ops_available()
    took = time.perf_counter() - start
    where = _build_dir()
    print(f"tailserve CPU kernels: {'ready' if ok else 'NOT available'} ({where}, {took:.1f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
