"""OutputProcessor: token ids from the engine -> text, stop strings, RequestOutputs.

Runs above the engine (in the API process when there is one): it detokenizes incrementally
(``IncrementalDetokenizer``, one per completion), ends a request on a stop string (the engine
is then told to stop it) and groups the ``n`` completions of one prompt back into one
``RequestOutput``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

from tailserve.data.step import EngineOutput
from tailserve.outputs import CompletionOutput, RequestOutput
from tailserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded ahead of the output so the first output token is spelled as it is after
# the prompt (a sentencepiece "▁Hello" mid-text is " Hello", not "Hello"). A handful covers any
# merge or byte sequence that can straddle the boundary.
_CONTEXT_TOKENS = 6


@dataclass
class _Completion:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    out: CompletionOutput
    timing: dict[str, Any] | None = None


@dataclass
class _Parent:
    output: RequestOutput
    children: dict[str, _Completion] = field(default_factory=dict)
    num_finished: int = 0


def find_stop(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last ``new_chars`` characters of ``text``."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    return best


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, str] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        child_params: dict[str, SamplingParams],
    ) -> None:
        parent = _Parent(RequestOutput(request_id, prompt, prompt_token_ids, outputs=[]))
        for index, (child_id, params) in enumerate(child_params.items()):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
            out = CompletionOutput(
                index, "", [], logprobs=[] if params.logprobs is not None else None
            )
            parent.children[child_id] = _Completion(index, params, detok, out)
            parent.output.outputs.append(out)
            self._child_to_parent[child_id] = request_id
        self._parents[request_id] = parent

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply engine outputs. Returns finished RequestOutputs and child ids to stop."""
        finished: list[RequestOutput] = []
        to_stop: list[str] = []
        for eo in outputs:
            parent_id = self._child_to_parent.get(eo.request_id)
            if parent_id is None:
                continue
            parent = self._parents[parent_id]
            child = parent.children[eo.request_id]
            out = child.out
            if out.finished and not eo.finished:
                continue  # tokens of a step that ran while a stop string was being handled
            stop_hit = not out.finished and self._append(child, eo)
            if stop_hit and not eo.finished:
                # Count it done when the engine confirms the stop, with its timing.
                to_stop.append(eo.request_id)
                continue
            if eo.finished:
                if out.finish_reason is None:
                    # A character split across the last tokens is only complete now.
                    out.text += child.detok.flush()
                    out.finish_reason = eo.finish_reason.value if eo.finish_reason else None
                    out.stop_reason = eo.stop_reason
                child.timing = eo.timing
                if child.index == 0:
                    parent.output.metrics = eo.timestamps
                    parent.output.num_cached_tokens = eo.num_cached_tokens
                parent.num_finished += 1
                if parent.num_finished == len(parent.children):
                    finished.append(self._finish(parent_id))
        return finished, to_stop

    def _append(self, child: _Completion, eo: EngineOutput) -> bool:
        """Add new tokens and text; True when a stop string ended the completion."""
        out = child.out
        params = child.params
        for i, token in enumerate(eo.new_token_ids):
            out.token_ids.append(token)
            if out.logprobs is not None and eo.new_logprobs is not None:
                out.logprobs.append(eo.new_logprobs[i])
            delta = child.detok.add(token)
            out.text += delta
            if params.stop and len(out.token_ids) >= params.min_tokens and delta:
                hit = find_stop(out.text, params.stop, len(delta))
                if hit is not None:
                    pos, stop = hit
                    end = pos + len(stop) if params.include_stop_str_in_output else pos
                    out.text = out.text[:end]
                    out.finish_reason = "stop"
                    out.stop_reason = stop
                    return True
        return False

    def _finish(self, parent_id: str) -> RequestOutput:
        parent = self._parents.pop(parent_id)
        for child_id, child in parent.children.items():
            self._child_to_parent.pop(child_id, None)
            if child.timing is not None:
                parent.output.timing.append(child.timing)
        parent.output.finished = True
        return parent.output

    def get(self, parent_id: str) -> RequestOutput | None:
        """The request's output so far (texts and tokens grow as ``process`` runs)."""
        parent = self._parents.get(parent_id)
        return parent.output if parent is not None else None

    def abort(self, parent_id: str) -> list[str]:
        """Forget a request; returns its child ids so the engine can abort them too."""
        parent = self._parents.pop(parent_id, None)
        if parent is None:
            return []
        for child_id in parent.children:
            self._child_to_parent.pop(child_id, None)
        return list(parent.children)


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
