"""``python -m tailserve.kernels``: build the CPU kernels now (``make setup`` runs this).

Exit status 1 when the build fails where it is required (a C++ compiler runs here, or
``TAILSERVE_REQUIRE_CPU_KERNELS=1``): setup stops instead of leaving the fast path untested.
Without a compiler it prints a warning and exits 0: the engine serves on its torch paths.
"""

from __future__ import annotations

import sys
import time

from tailserve.kernels import (
    _build_dir,
    cpu_ops_available,
    cpu_ops_error,
    cpu_ops_required,
    cxx_compiler,
)


def main() -> int:
    start = time.perf_counter()
    ok = cpu_ops_available()
    took = time.perf_counter() - start
    if ok:
        print(f"tailserve CPU kernels: ready ({_build_dir()}, {took:.1f} s)")
        return 0
    reason = cpu_ops_error() or "unknown error"
    if cpu_ops_required():
        compiler = cxx_compiler()
        why = f"C++ compiler {compiler}" if compiler else "TAILSERVE_REQUIRE_CPU_KERNELS=1"
        print(f"tailserve CPU kernels: build FAILED ({reason}); they are required here ({why})",
              file=sys.stderr)
        return 1
    advice = "" if cxx_compiler() else (
        " Install a C++ compiler (g++) and run `python -m tailserve.kernels` to build them.")
    print(f"tailserve CPU kernels: NOT available ({reason}); WARNING: the engine will run its "
          f"slower torch fallbacks.{advice}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
