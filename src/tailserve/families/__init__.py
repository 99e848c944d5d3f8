"""Model families as data: what differs between the Llama-family decoders tailserve serves,
declared once per family, one file each. ``model/llama.py`` is the one decoder that reads these
declarations (through ``ModelConfig``); the loader reads a family's stored weight names.

Adding a family is one file here (its ``FAMILY``), one line in ``FAMILIES`` and one parity test
against transformers (tests/test_families.py). A feature no declaration can express (another
activation, attention soft-capping ...) is refused by name at load
(``model_features.py``), never skipped.

Plain data, no torch: ``config/`` (the bottom layer) resolves a checkpoint against it.
"""

from __future__ import annotations

from tailserve.families.base import Family
from tailserve.families.gemma3 import FAMILY as GEMMA3
from tailserve.families.llama import FAMILY as LLAMA
from tailserve.families.mistral import FAMILY as MISTRAL
from tailserve.families.phi3 import FAMILY as PHI3
from tailserve.families.qwen2 import FAMILY as QWEN2
from tailserve.families.qwen3 import FAMILY as QWEN3

# By the Hugging Face class name config.json's ``architectures`` gives.
FAMILIES: dict[str, Family] = {f.architecture: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3,
                                                           GEMMA3)}
# By GGUF's general.architecture, for the families whose GGUF tensors the loader maps.
GGUF_FAMILIES: dict[str, Family] = {
    f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture is not None
}

__all__ = ["FAMILIES", "GGUF_FAMILIES", "Family"]
