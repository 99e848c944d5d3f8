"""A chat completion's text as an assistant message: reasoning (``reasoning.py``), then tool
calls (``tool_parser.py``) out of what is left, streamed or whole.

``ChatOutput`` is the parsed message as plain data, for the chat formatter and for any other
endpoint built on the chat path (it reads ``tool_calls`` as ``ToolCall``s, not JSON).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tailserve.server.reasoning import ReasoningParser, ReasoningParserName
from tailserve.server.tool_parser import ToolCall, ToolCallDelta, ToolCallParser, accumulate
from tailserve.server.tools import ToolRequest


@dataclass(frozen=True)
class ChatOutput:
    """One choice's message. ``content`` is None when the text held only calls or reasoning;
    ``reasoning_content`` is None when there was no reasoning (or no parser)."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ChatDelta:
    content: str
    reasoning_content: str
    tool_calls: list[ToolCallDelta]


class ChatOutputParser:
    """One choice's parser: ``feed`` its text deltas, then ``finish``."""

    def __init__(self, tools: ToolRequest | None, reasoning: ReasoningParserName | None
                 ) -> None:
        # A grammar-forced call starts at the first token: there is no thinking to split off.
        forced = tools is not None and tools.choice in ("required", "named")
        self.reasoning = None if reasoning is None or forced else ReasoningParser(reasoning)
        self.tools = ToolCallParser(tools)

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls

    @property
    def saw_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.saw_reasoning

    def feed(self, text: str) -> ChatDelta:
        if self.reasoning is None:
            content, calls = self.tools.feed(text)
            return ChatDelta(content, "", calls)
        thought, rest = self.reasoning.feed(text)
        content, calls = self.tools.feed(rest)
        return ChatDelta(content, thought, calls)

    def finish(self) -> ChatDelta:
        thought, content = "", ""
        calls: list[ToolCallDelta] = []
        if self.reasoning is not None:
            thought, rest = self.reasoning.finish()
            content, calls = self.tools.feed(rest)
        more, rest_calls = self.tools.finish()
        return ChatDelta(content + more, thought, calls + rest_calls)


def parse_chat_output(text: str, tools: ToolRequest | None,
                      reasoning: ReasoningParserName | None) -> ChatOutput:
    """A whole completion's message (the streamed parse in one piece)."""
    parser = ChatOutputParser(tools, reasoning)
    a, b = parser.feed(text), parser.finish()
    content = a.content + b.content
    calls = accumulate(a.tool_calls + b.tool_calls)
    thought = a.reasoning_content + b.reasoning_content
    if not content and (calls or parser.saw_reasoning):
        return ChatOutput(None, thought if parser.saw_reasoning else None, calls)
    return ChatOutput(content, thought if parser.saw_reasoning else None, calls)
