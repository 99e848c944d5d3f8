"""Tokenizers: load a fast tokenizer (Hugging Face folder or GGUF).

Loading is cached per process, keyed by the files' paths, sizes and modification times: the CLI,
``LLM`` and every test load the bundled model, and building its tokenizer from GGUF metadata
costs about a second. A cached tokenizer is shared by every caller -- treat it as read-only.

``transformers`` is imported lazily: it takes seconds to import. Turning generated ids back into
text, incrementally, is output processing (``engine/output_processor.py``'s
``IncrementalDetokenizer``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tailserve.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A Hugging Face folder needs one of these to build a fast tokenizer (the second is converted).
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_HF_TOKENIZER_STAMPED = (
    *_HF_TOKENIZER_FILES,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
)

# One load at a time per process: the engine builds llguidance's tokenizer in a thread beside
# the model load, and transformers resolves its lazily imported modules without a lock (two
# threads at once got "cannot import name 'AutoTokenizer'"). The second caller then finds the
# first one's tokenizer in the cache instead of building it again.
_LOAD_LOCK = threading.Lock()


def load_hf_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer (with its chat template) of a Hugging Face model folder."""
    if not any(os.path.isfile(os.path.join(folder, name)) for name in _HF_TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer in {folder}: expected tokenizer.json (or tokenizer.model) next to "
            f"tokenizer_config.json; found: {folder_listing(folder)}"
        )
    with _LOAD_LOCK:
        return _load_hf_cached(folder, _stamp(folder, _HF_TOKENIZER_STAMPED))


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer and chat template stored in a GGUF file's metadata."""
    folder, name = os.path.split(path)
    with _LOAD_LOCK:
        return _load_gguf_cached(path, _stamp(folder, (name,)))


@functools.lru_cache(maxsize=8)
def _load_hf_cached(folder: str, stamp: tuple[tuple[str, int, int], ...]) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot build the tokenizer in {folder}: {exc}") from exc
    if not tokenizer.is_fast:
        raise ModelLoadError(
            f"the tokenizer in {folder} is a slow (Python) tokenizer; tailserve needs a fast one "
            "(tokenizer.json)"
        )
    return tokenizer


@functools.lru_cache(maxsize=8)
def _load_gguf_cached(path: str, stamp: tuple[tuple[str, int, int], ...]) -> Any:
    # The generic fast class, not AutoTokenizer: AutoTokenizer first rebuilds the whole model
    # config through gguf.GGUFReader to pick a class (~8 s), while the backend it ends up with is
    # the same one built from the file's vocabulary here (~1 s).
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(path)
    try:
        return PreTrainedTokenizerFast.from_pretrained(
            folder, gguf_file=name, local_files_only=True
        )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(
            f"cannot build a tokenizer from the GGUF metadata of {path}: {exc}"
        ) from exc


def _stamp(folder: str, names: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """(name, size, mtime) of each file that exists: changes whenever a file is replaced."""
    stamp = []
    for name in names:
        try:
            st = os.stat(os.path.join(folder, name))
        except FileNotFoundError:
            continue
        stamp.append((name, st.st_size, st.st_mtime_ns))
    return tuple(stamp)


def folder_listing(folder: str, limit: int = 12) -> str:
    """What a folder holds, for error messages that name what was found."""
    names = sorted(os.listdir(folder))
    shown = ", ".join(names[:limit]) + (
        f", ... ({len(names)} entries)" if len(names) > limit else ""
    )
    return shown or "nothing (empty folder)"
