"""Tool calls read out of a chat completion's text, as it streams.

One incremental parser per choice turns text deltas into content text and ``ToolCallDelta``s
(OpenAI's streamed shape: a call's first delta carries its index, id and name with empty
arguments, the next ones fragments of the arguments). A non-streamed response runs the same
parser over the whole text (``parse_tool_calls``), so the two always agree.

By ``tool_choice`` (``tools.py``):

- named: the grammar made the text the arguments object; the call is announced at once and
  every delta is an arguments fragment.
- ``required``: the grammar made it ``{"name": ..., "arguments": ...}`` (or an array of them);
  a call is announced once its name is read, then its arguments stream as they come.
- ``auto``: the documented format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (several allowed), or a text that is only such a JSON object (or an array of them). A block is
  held back until it closes, then becomes a call when it parses, names a declared function and
  has object arguments (``parameters`` is read as ``arguments`` too); otherwise it is content,
  as written. Whitespace next to a call is dropped from the content. Without
  ``parallel_tool_calls`` only the first call is kept. Under a strict ``auto``'s grammar only
  ``<tool_call>`` blocks are read (the grammar checked those; a bare JSON text it did not).
- ``none`` or no tools: the text is content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tailserve.server.reasoning import partial_suffix
from tailserve.server.tools import ToolRequest

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A call object's head when the name comes first (as the grammar writes it).
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolCall:
    """One finished call: ``arguments`` is JSON text, as OpenAI returns it."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of call ``index``: the first has ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def accumulate(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls a list of deltas streams, in index order."""
    heads: dict[int, ToolCallDelta] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        if d.id is not None:
            heads[d.index] = d
        args.setdefault(d.index, []).append(d.arguments)
    return [ToolCall(str(heads[i].id), str(heads[i].name), "".join(args[i]))
            for i in sorted(heads)]


class ToolCallParser:
    """The parser for ``tools``: ``feed`` a text delta, ``finish`` at the end; each returns
    the content text and the call deltas it completes."""

    def __init__(self, tools: ToolRequest | None) -> None:
        self.tools = tools
        self.mode = "none" if tools is None else tools.choice
        self.num_calls = 0
        self._buf = ""
        # auto: "text" (content), "tag" (inside <tool_call>), "bare" (the whole text is JSON)
        # required: "between" (calls), "head", "args", "tail"
        self._state = "between" if self.mode == "required" else "text"
        self._seen_text = False  # auto: a non-space character went by
        # auto: whether a text that is only JSON may be a call (not under the strict grammar).
        self._bare = tools is not None and not tools.strict_auto
        self._ws = ""  # auto: whitespace held until we know whether a call is next to it
        self._tag_ws = ""
        self._after_call = False
        self._value: _ValueEnd | None = None

    # ---------------------------------------------------------------- interface
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return "", self._named(text)
        self._buf += text
        return self._required() if self.mode == "required" else self._auto(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        if self.mode == "none":
            return "", []
        if self.mode == "named":
            return "", self._named("") if self.num_calls == 0 else []
        if self.mode == "required":
            done, out = self._required()
            # Cut off (max_tokens) before a call's name: what there is stays content.
            rest = self._buf if self._state == "head" else ""
            self._buf = ""
            return done + rest, out
        return self._auto(final=True)

    # ---------------------------------------------------------------- named
    def _named(self, text: str) -> list[ToolCallDelta]:
        out = []
        if self.num_calls == 0:
            assert self.tools is not None and self.tools.named is not None
            out.append(ToolCallDelta(0, "", new_call_id(), self.tools.named))
            self.num_calls = 1
        if text:
            out.append(ToolCallDelta(0, text))
        return out

    # ---------------------------------------------------------------- required
    def _required(self) -> tuple[str, list[ToolCallDelta]]:
        out: list[ToolCallDelta] = []
        content: list[str] = []
        while self._buf:
            if self._state == "between":
                self._buf = self._buf.lstrip(" \t\r\n[],")
                if not self._buf:
                    break
                self._state = "head"
            if self._state == "head":
                m = _HEAD.match(self._buf)
                if m is None:
                    # Not (yet) name-first: once the object closes, read it whole.
                    end = _ValueEnd().feed(self._buf)
                    if end is None:
                        break
                    if not self._calls(self._buf[:end], out):
                        content.append(self._buf[:end])  # not a call after all
                    self._buf, self._state = self._buf[end:], "between"
                    continue
                out.append(ToolCallDelta(self.num_calls, "", new_call_id(),
                                         json.loads(f'"{m.group(1)}"')))
                self.num_calls += 1
                self._buf = self._buf[m.end():]
                self._state, self._value = "args", _ValueEnd()
            if self._state == "args":
                assert self._value is not None
                end = self._value.feed(self._buf)
                piece = self._buf if end is None else self._buf[:end]
                if piece:
                    out.append(ToolCallDelta(self.num_calls - 1, piece))
                self._buf = "" if end is None else self._buf[end:]
                if end is None:
                    break
                self._state = "tail"
            if self._state == "tail":
                # The call object's closing brace (nothing else under the grammar).
                i = self._buf.find("}")
                if i < 0:
                    self._buf = ""
                    break
                self._buf, self._state = self._buf[i + 1:], "between"
        return "".join(content), out

    # ---------------------------------------------------------------- auto
    def _auto(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._state == "text":
                if not self._seen_text:
                    stripped = self._buf.lstrip()
                    if not stripped:
                        if final:
                            self._content(self._buf, content)
                            self._buf = ""
                        break
                    self._seen_text = True
                    if stripped[0] in "{[" and self._bare:
                        self._state = "bare"
                        continue
                i = self._buf.find(OPEN)
                if i >= 0:
                    self._content(self._buf[:i], content)
                    # Dropped if the block is a call, given back if it is not.
                    self._tag_ws, self._ws = self._ws, ""
                    self._buf, self._state = self._buf[i + len(OPEN):], "tag"
                    continue
                keep = 0 if final else partial_suffix(self._buf, OPEN)
                self._content(self._buf[:len(self._buf) - keep], content)
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._state == "tag":
                i = self._buf.find(CLOSE)
                if i < 0 and not final:
                    break
                inner = self._buf if i < 0 else self._buf[:i]
                rest = "" if i < 0 else self._buf[i + len(CLOSE):]
                if not self._calls(inner, calls):
                    self._content(self._tag_ws + OPEN + inner + ("" if i < 0 else CLOSE),
                                  content)
                self._buf, self._state = rest, "text"
                if i < 0:
                    break
                continue
            # bare: the whole output, read at the end
            if not final:
                break
            if not self._calls(self._buf, calls):
                content.append(self._buf)
            self._buf = ""
            break
        if final and self.num_calls == 0:
            content.append(self._ws)
            self._ws = ""
        return "".join(content), calls

    def _content(self, text: str, out: list[str]) -> None:
        """Content, with whitespace next to a call dropped (held until known)."""
        s = self._ws + text
        if self._after_call:
            s = s.lstrip()
            if not s:
                self._ws = ""
                return
            self._after_call = False
        body = s.rstrip()
        self._ws = s[len(body):]
        if body:
            out.append(body)

    def _calls(self, text: str, out: list[ToolCallDelta]) -> bool:
        """Append the calls ``text`` holds; False (nothing appended) when it holds none."""
        assert self.tools is not None
        try:
            doc = json.loads(text)
        except ValueError:
            return False
        items = doc if isinstance(doc, list) else [doc]
        found = []
        for item in items:
            name = item.get("name") if isinstance(item, dict) else None
            if not isinstance(name, str) or name not in self.tools.functions:
                return False
            args = item.get("arguments", item.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    return False
            if not isinstance(args, dict):
                return False
            found.append((name, json.dumps(args, ensure_ascii=False)))
        if not found:
            return False
        for name, args_text in found:
            if self.num_calls and not self.tools.parallel:
                break
            out.append(ToolCallDelta(self.num_calls, "", new_call_id(), name))
            out.append(ToolCallDelta(self.num_calls, args_text))
            self.num_calls += 1
        self._after_call = True
        return True


class _ValueEnd:
    """Finds where one JSON value ends in text fed piece by piece (the value is well formed:
    the grammar wrote it)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.in_string = False
        self.escaped = False
        self.scalar = False

    def feed(self, s: str) -> int | None:
        """The index in ``s`` just past the value's end, or None when it goes on."""
        for i, c in enumerate(s):
            if not self.started:
                if c in " \t\r\n":
                    continue
                self.started = True
                if c == '"':
                    self.in_string = True
                elif c in "{[":
                    self.depth = 1
                else:
                    self.scalar = True
                continue
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif self.scalar:
                if c in ",}] \t\r\n":
                    return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def parse_tool_calls(text: str, tools: ToolRequest | None) -> tuple[str, list[ToolCall]]:
    """A whole text's content and calls (the streamed parse in one piece)."""
    parser = ToolCallParser(tools)
    content, deltas = parser.feed(text)
    more, rest = parser.finish()
    return content + more, accumulate(deltas + rest)
