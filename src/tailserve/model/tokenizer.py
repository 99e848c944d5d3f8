"""Tokenizers: load a fast tokenizer (Hugging Face folder or GGUF) and detokenize a token stream.

Loading is cached per process, keyed by the files' paths, sizes and modification times: the CLI,
``LLM`` and every test load the bundled model, and building its tokenizer from GGUF metadata
costs about a second. A cached tokenizer is shared by every caller -- treat it as read-only.

``transformers`` is imported lazily: it takes seconds to import, and the detokenizer does not
need it (it drives the ``tokenizers`` backend directly).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

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
# Prompt tokens decoded ahead of the output so the first output token is spelled as it is after
# the prompt (a sentencepiece "▁Hello" mid-text is " Hello", not "Hello"). A handful covers any
# merge or byte sequence that can straddle the boundary.
_CONTEXT_TOKENS = 6


def load_hf_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer (with its chat template) of a Hugging Face model folder."""
    if not any(os.path.isfile(os.path.join(folder, name)) for name in _HF_TOKENIZER_FILES):
        raise ModelLoadError(
            f"no tokenizer in {folder}: expected tokenizer.json (or tokenizer.model) next to "
            f"tokenizer_config.json; found: {folder_listing(folder)}"
        )
    return _load_hf_cached(folder, _stamp(folder, _HF_TOKENIZER_STAMPED))


def load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer and chat template stored in a GGUF file's metadata."""
    folder, name = os.path.split(path)
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


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into the text each one adds.

    Built on ``tokenizers.decoders.DecodeStream``, which decodes only a short window of recent ids
    per step (O(1) per token) and holds back ids that end inside a multi-byte UTF-8 character
    until a later id completes it. Invariant, for the byte-level BPE tokenizers of Llama 3,
    Qwen2 and SmolLM2::

        "".join(add(t) for t in ids) + flush() == tokenizer.decode(ids, skip_special_tokens=...)

    (``clean_up_tokenization_spaces`` is not applied.) For sentencepiece tokenizers the first
    delta keeps the leading space the prompt context gives it, which ``decode(ids)`` strips.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError(
                f"IncrementalDetokenizer needs a fast tokenizer, got {type(tokenizer).__name__}"
            )
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._settled = context  # last ids already turned into text; context for flush()
        self._pending: list[int] = []  # ids the stream holds back (an incomplete character)
        self._chunks: list[str] = []
        self.token_ids: list[int] = []

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the text it completes ("" while a character is open)."""
        self.token_ids.append(token_id)
        delta = self._stream.step(self._backend, token_id)
        if delta is None:
            self._pending.append(token_id)
            return ""
        if self._pending:
            self._settled = [*self._settled, *self._pending, token_id][-_CONTEXT_TOKENS:]
            self._pending = []
        else:
            self._settled = [*self._settled[1 - _CONTEXT_TOKENS :], token_id]
        if delta:
            self._chunks.append(delta)
        return delta

    def flush(self) -> str:
        """The text of held-back ids, rendered as ``decode`` renders them (U+FFFD for a character
        the model never finished). Call it once the request ends; ids added after a flush are
        decoded afresh, as the start of a new text."""
        if not self._pending:
            return ""
        prefix = self._decode(self._settled)
        full = self._decode([*self._settled, *self._pending])
        delta = full[len(prefix) :] if full.startswith(prefix) else self._decode(self._pending)
        # The stream cannot take back the replacement characters just emitted, so it restarts
        # without context instead of letting later bytes complete the flushed character.
        self._settled = []
        self._pending = []
        self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
        if delta:
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text produced so far (held-back ids excluded until they complete or flush)."""
        if len(self._chunks) > 1:  # join lazily, once per read, and keep the result
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def _decode(self, ids: list[int]) -> str:
        text: str = self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return text
