"""What the parsers return: a whole reply's content and tool calls, and the pieces of a
streamed reply, shaped as OpenAI's chat message and stream delta (``as_openai``)."""

import attrs


@attrs.frozen
class ToolCall:
    """``arguments``: the JSON text of the arguments as the model wrote it."""

    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedReply:
    """``content``: the text outside the tool calls (None when there is none)."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


@attrs.frozen
class ToolCallDelta:
    """One call's piece of a stream: its first piece carries ``id`` and ``name``; the
    ``arguments`` pieces, joined, are the call's arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict:
        function = {"arguments": self.arguments} if self.name is None else \
            {"name": self.name, "arguments": self.arguments}
        head = {} if self.id is None else {"id": self.id, "type": "function"}
        return {"index": self.index, **head, "function": function}


@attrs.frozen
class DeltaMessage:
    """One stream chunk's delta: new content, new reasoning, new pieces of tool calls."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def as_openai(self) -> dict:
        delta = {name: getattr(self, name) for name in ("content", "reasoning_content")
                 if getattr(self, name) is not None}
        if self.tool_calls:
            delta["tool_calls"] = [call.as_openai() for call in self.tool_calls]
        return delta
