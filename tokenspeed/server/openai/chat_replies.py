"""A chat reply as OpenAI's message: the reasoning split off first (``reasoning_content``),
then the tool calls read from what is left (``tool_calls``), whole or as stream deltas
that join to the whole (vLLM's chain and its delta shapes: each parser's stream is the
differences between its scans of the growing text, so the pieces add up to its parse).
A reply that made calls finishes with ``"tool_calls"`` when it ended as it chose to and
every call's arguments are a whole JSON object; a call cut short (by ``max_tokens``, a stop
string, the end of sequence) is still shown as far as it was written, as the stream has
sent it, but its reply keeps its own finish, so a client does not run a call half made.
"""

import json
from collections.abc import Iterable

import attrs

from tokenspeed.parsers import DeltaMessage, ThinkParser, ToolParser, reasoning_parser, tool_parser

TOOL_CALLS = "tool_calls"


@attrs.frozen
class ReplyParsing:
    """How one request's replies are read: ``reasoning`` and ``tools`` parsers (None: the
    reply is not read that way)."""

    reasoning: ThinkParser | None = None
    tools: ToolParser | None = None
    single_call: bool = False   # the first call only (``parallel_tool_calls: false``)

    @classmethod
    def of(cls, reasoning_name: str | None, tools_name: str | None,
           single_call: bool = False, prompt: str | None = None) -> "ReplyParsing | None":
        """The parsing by the parsers' names; None when neither is named (the reply is plain
        text). ``prompt``: the chat prompt's text, whose last tag may say the reply starts
        inside or outside a thought (``ThinkParser.after``)."""
        if reasoning_name is None and tools_name is None:
            return None
        return cls(reasoning_parser(reasoning_name).after(prompt) if reasoning_name else None,
                   tool_parser(tools_name) if tools_name else None, single_call)

    def message(self, text: str) -> dict:
        """A whole reply's message fields: ``content``, and ``reasoning_content`` and
        ``tool_calls`` where their parsers read them."""
        fields = {}
        content = text
        if self.reasoning is not None:
            fields["reasoning_content"], content = self.reasoning.parse(text)
        fields["content"] = content
        if self.tools is not None and content is not None:
            parsed = self.tools.parse(content)
            fields["content"] = parsed.content
            calls = parsed.tool_calls[:1] if self.single_call else parsed.tool_calls
            if calls:
                fields[TOOL_CALLS] = [call.as_openai() for call in calls]
        return fields

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


def finish_reason(reason: str | None, arguments: Iterable[str]) -> str | None:
    """``"tool_calls"`` for a reply that ended as it chose to with calls, given their
    ``arguments``' texts, each a whole JSON object."""
    arguments = list(arguments)
    return TOOL_CALLS if arguments and reason == "stop" and all(map(_whole_object, arguments)) else reason


def _whole_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


class ReplyStream:
    """One streamed reply: ``feed`` each new piece of text, ``finish`` at its end; each
    returns the deltas to send. ``arguments``: each call's arguments sent so far."""

    def __init__(self, parsing: ReplyParsing):
        self._reasoning = parsing.reasoning.stream() if parsing.reasoning is not None else None
        self._tools = parsing.tools.stream() if parsing.tools is not None else None
        self._single_call = parsing.single_call
        self._arguments: dict[int, str] = {}

    @property
    def arguments(self) -> list[str]:
        return [self._arguments[i] for i in sorted(self._arguments)]

    def feed(self, piece: str) -> list[DeltaMessage]:
        split = self._reasoning.feed(piece) if self._reasoning is not None else [DeltaMessage(content=piece)]
        return self._through_tools(split, final=False)

    def finish(self) -> list[DeltaMessage]:
        split = self._reasoning.finish() if self._reasoning is not None else []
        return self._through_tools(split, final=True)

    def _through_tools(self, split: list[DeltaMessage], final: bool) -> list[DeltaMessage]:
        """The reasoning as it is; the content through the tool-call parser, if there is one."""
        if self._tools is None:
            return [m for m in split if m.content or m.reasoning_content]
        out = []
        for message in split:
            if message.reasoning_content:
                out.append(DeltaMessage(reasoning_content=message.reasoning_content))
            if message.content:
                out += self._tools.feed(message.content)
        if final:
            out += self._tools.finish()
        if self._single_call:
            out = [m for m in map(_first_call_only, out) if m is not None]
        for call in (call for m in out for call in m.tool_calls):
            self._arguments[call.index] = self._arguments.get(call.index, "") + call.arguments
        return out


def _first_call_only(message: DeltaMessage) -> DeltaMessage | None:
    """``message`` without the deltas of calls after the first (None if nothing is left)."""
    if not message.tool_calls or all(call.index == 0 for call in message.tool_calls):
        return message
    calls = [call for call in message.tool_calls if call.index == 0]
    if not calls and not message.content and not message.reasoning_content:
        return None
    return attrs.evolve(message, tool_calls=tuple(calls))
