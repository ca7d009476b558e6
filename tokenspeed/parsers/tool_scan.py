"""What a tool-call parser sees in a reply so far, and how it turns into stream deltas.

Each format (``hermes``, ``llama3_json``, ``mistral``) is one function, ``scan(text,
final) -> ToolScan``: the content that can be shown and the calls named so far, each with
the argument text written so far. A scan of a longer text only extends a scan of a
shorter one (content and arguments grow at their ends, calls are appended), with one
exception: the final scan of a reply that named no call at all shows its whole text as
content (what looked like the start of a call was not one). So a stream is the
differences between successive scans (``ToolCallStream``), and its pieces join to the
whole reply's parse (``ToolParser.parse``).
"""

import abc
import json
import uuid
from collections.abc import Callable

import attrs

from tokenspeed.errors import InternalError
from tokenspeed.parsers.growing_text import grown, held_tail
from tokenspeed.parsers.json_scan import ObjectScan
from tokenspeed.parsers.records import DeltaMessage, ParsedReply, ToolCall, ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")


@attrs.frozen
class CallScan:
    name: str
    arguments: str


@attrs.frozen
class ToolScan:
    content: str
    calls: tuple[CallScan, ...] = ()


def shown_content(text: str, marker: str, final: bool) -> str:
    """The content before ``marker``: all of it once final (or once the marker is there),
    less trailing whitespace and what may be the marker's start while the text grows."""
    at = text.find(marker)
    if at >= 0:
        return text[:at].rstrip()
    return text if final else text[:len(text) - held_tail(text, marker)].rstrip()


def call_of(text: str, scan: ObjectScan) -> CallScan | None:
    """A call named by an object's ``name`` field, with its arguments' text so far (``{}``
    once the object closes without any): the first of ``ARGUMENT_KEYS`` written, since a
    later one would take back what a stream sent. Arguments given as a JSON string are its
    value."""
    name = scan.fields.get("name")
    if name is None or name[1] is None or text[name[0]] != '"':
        return None
    key = next((k for k in scan.fields if k in ARGUMENT_KEYS), None)
    if key is None:
        return CallScan(json.loads(text[name[0]:name[1]]), "{}" if scan.end is not None else "")
    start, end = scan.fields[key]
    return CallScan(json.loads(text[name[0]:name[1]]), argument_text(text, start, end))


def argument_text(text: str, start: int, end: int | None) -> str:
    if text[start] == '"':
        return json.loads(text[start:end]) if end is not None else ""
    return text[start:] if end is None else text[start:end]


def with_content_fallback(text: str, scan: ToolScan, final: bool) -> ToolScan:
    """A final reply that named no call is all content."""
    return ToolScan(text) if final and not scan.calls else scan


def random_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One streamed reply: ``feed`` each new piece of text, ``finish`` at its end; each
    returns the deltas to send (none, or one ``DeltaMessage``)."""

    def __init__(self, scan: Callable[[str, bool], ToolScan], new_id: Callable[[], str]):
        self._scan, self._new_id = scan, new_id
        self._text, self._content, self._calls = "", "", []

    def feed(self, piece: str) -> list[DeltaMessage]:
        self._text += piece
        return self._diff(self._scan(self._text, False))

    def finish(self) -> list[DeltaMessage]:
        return self._diff(self._scan(self._text, True))

    def _diff(self, scan: ToolScan) -> list[DeltaMessage]:
        content = grown("content", self._content, scan.content)
        self._content = scan.content
        calls = [self._call_delta(index, call) for index, call in enumerate(scan.calls)]
        calls = tuple(c for c in calls if c is not None)
        return [DeltaMessage(content=content or None, tool_calls=calls)] if content or calls else []

    def _call_delta(self, index: int, call: CallScan) -> ToolCallDelta | None:
        if index == len(self._calls):
            self._calls.append(call)
            return ToolCallDelta(index, self._new_id(), call.name, call.arguments)
        before, self._calls[index] = self._calls[index], call
        if call.name != before.name:
            raise InternalError(f"tool call {index} was named {before.name!r}, now {call.name!r}")
        more = grown(f"tool call {index}'s arguments", before.arguments, call.arguments)
        return ToolCallDelta(index, arguments=more) if more else None



class ToolParser(abc.ABC):
    """A format's whole-reply parse and its stream; ``new_id`` makes call ids (random, in
    OpenAI's ``call_`` form, unless a format asks for its own)."""

    name: str = ""

    def __init__(self, new_id: Callable[[], str] = random_call_id):
        self.new_id = new_id

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> ToolScan:
        """The reply so far (``final``: the whole reply) as content and named calls."""

    def parse(self, text: str) -> ParsedReply:
        scan = self.scan(text, True)
        calls = tuple(ToolCall(self.new_id(), c.name, c.arguments) for c in scan.calls)
        return ParsedReply(scan.content or None, calls)

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.scan, self.new_id)
