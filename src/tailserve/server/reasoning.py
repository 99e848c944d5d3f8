"""The reasoning split (``--reasoning-parser``): a completion's thinking, written between
``<think>`` and ``</think>``, goes to the message's ``reasoning_content``
(``delta.reasoning_content`` when streaming) and the rest to ``content``, as vLLM's parsers of
the same names do.

- ``deepseek_r1``: the template may open ``<think>`` in the prompt, so the opening tag is
  optional; everything before ``</think>`` is reasoning, and a text without ``</think>`` is all
  reasoning (cut off while thinking).
- ``qwen3``: reasoning only when the text opens with ``<think>`` (leading whitespace allowed);
  otherwise it is all content. An unclosed ``<think>`` is reasoning to the end.

Incremental: a tag split across deltas is held back until it is known, so streamed pieces
joined are exactly the non-streamed split.
"""

from __future__ import annotations

from typing import Literal, get_args

ReasoningParserName = Literal["deepseek_r1", "qwen3"]
REASONING_PARSERS: tuple[str, ...] = get_args(ReasoningParserName)

THINK, END = "<think>", "</think>"


class ReasoningParser:
    """One choice's split: ``feed`` a text delta, ``finish`` at the end; each returns
    ``(reasoning, content)`` text."""

    def __init__(self, name: ReasoningParserName) -> None:
        self.name = name
        self._state = "start"  # then "think" or "content"
        self._buf = ""
        self.saw_reasoning = False

    def feed(self, text: str) -> tuple[str, str]:
        if self._state == "content":
            return "", text
        self._buf += text
        return self._step(final=False)

    def finish(self) -> tuple[str, str]:
        if self._state == "content":
            return "", ""
        return self._step(final=True)

    def _step(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        if self._state == "start":
            head = self._buf.lstrip()
            if final and not head:
                self._state, content, self._buf = "content", self._buf, ""
                return "", content
            if head.startswith(THINK):
                self._buf = head[len(THINK):]
                self._state = "think"
            elif THINK.startswith(head) and not final:
                return "", ""  # may still become <think>
            elif self.name == "deepseek_r1":
                self._state = "think"  # the prompt opened it
            else:
                self._state, content, self._buf = "content", self._buf, ""
                return "", content
            self.saw_reasoning = True
        i = self._buf.find(END)
        if i >= 0:
            reasoning, content = self._buf[:i], self._buf[i + len(END):]
            self._state, self._buf = "content", ""
            return reasoning, content
        keep = 0 if final else partial_suffix(self._buf, END)
        reasoning = self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(self._buf) - keep:]
        return reasoning, ""


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (held back, as it may be
    the tag's first characters)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split_reasoning(text: str, name: ReasoningParserName) -> tuple[str | None, str]:
    """A whole text's reasoning (None when it has none) and content."""
    parser = ReasoningParser(name)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2 if parser.saw_reasoning else None), c1 + c2
