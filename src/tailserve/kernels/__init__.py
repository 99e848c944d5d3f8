"""Compiled CPU kernels (``torch.ops.tailserve.*``), built once per machine, optional.

The sources in ``csrc/`` are compiled with torch's C++ extension tooling the first time they
are needed (``make setup`` does it ahead of time: ``python -m tailserve.kernels``) into a cache
directory keyed by the source and torch version, then loaded as a library of torch ops. Built
with ``-march=native``: the cache is per machine, like the kernels' speed.

When no compiler is available, or ``TAILSERVE_CPU_KERNELS=0``, ``cpu_ops_available()`` is
False and callers keep their pure-torch paths: every kernel here has a torch equivalent that
the tests compare it against.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from tailserve import envs

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "cpu_ops.cpp", _CSRC / "decode_layers.cpp"]
_HEADERS = [_CSRC / "cpu_ops.h"]
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, bool] = {}


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        digest.update(src.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    digest.update(torch.__version__.encode())
    root = envs.TAILSERVE_KERNEL_CACHE.get() or Path.home() / ".cache" / "tailserve"
    return Path(root) / "kernels" / digest.hexdigest()[:16]


def _enabled() -> bool:
    return envs.TAILSERVE_CPU_KERNELS.get()


def cpu_ops_available() -> bool:
    """Build (first time on this machine) and load the CPU kernels; False if they cannot be."""
    if not _enabled():
        return False
    with _lock:
        if "ok" in _state:
            return _state["ok"]
        try:
            from torch.utils import cpp_extension

            build_dir = _build_dir()
            build_dir.mkdir(parents=True, exist_ok=True)
            cpp_extension.load(
                name="tailserve_cpu_ops",
                sources=[str(s) for s in _SOURCES],
                extra_cflags=_FLAGS,
                # libgomp by soname: the copy torch already loaded, one OpenMP runtime.
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,
                verbose=False,
            )
            _state["ok"] = True
        except Exception as exc:  # no compiler, headers or ninja: the torch paths still work
            log.warning("tailserve CPU kernels unavailable, using torch fallbacks: %s", exc)
            _state["ok"] = False
        return _state["ok"]
