"""Where a JSON value ends in text that may still be growing.

A streamed tool call is a JSON object arriving a few characters at a time. The parsers
need the spans of its fields (the name, the arguments) as soon as they exist, and the
same spans once the text is whole, so that the argument text streamed piece by piece
joins to the argument text of the whole reply. A span is decided by the characters
before its end alone: more text never moves it.
"""

import json
import re

import attrs

STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
SCALAR = re.compile(r"[-+0-9.eEa-zA-Z]+")
WHITESPACE = re.compile(r"\s*")
FIELD_HEAD = re.compile(r'("(?:[^"\\]|\\.)*")\s*:\s*', re.DOTALL)   # "key": up to the value
UNTIL_VALUE = re.compile(r"\s*(:\s*)?")
STRUCTURE = re.compile(r'[\[\]{}"]')   # what changes the depth, or opens a string


def skip_space(text: str, at: int) -> int:
    return WHITESPACE.match(text, at).end()


def value_end(text: str, start: int) -> int | None:
    """The index past the JSON value that starts at ``text[start]``, or None when the text
    ends before it does (a number or literal at the very end may still grow)."""
    first = text[start]
    if first == '"':
        string = STRING.match(text, start)
        return string.end() if string else None
    if first in "{[":
        return _container_end(text, start)
    scalar = SCALAR.match(text, start)
    end = scalar.end() if scalar else start + 1
    return end if end < len(text) else None


def _container_end(text: str, start: int) -> int | None:
    """Jumps from bracket to bracket (a reply's arguments are rescanned at every piece)."""
    depth, found = 0, STRUCTURE.search(text, start)
    while found:
        at = found.start()
        if text[at] == '"':
            string = STRING.match(text, at)
            if string is None:
                return None
            found = STRUCTURE.search(text, string.end())
            continue
        depth += 1 if text[at] in "{[" else -1
        if depth == 0:
            return at + 1
        found = STRUCTURE.search(text, at + 1)
    return None


@attrs.frozen
class ObjectScan:
    """The fields of a JSON object seen so far: key -> (value start, value end or None
    while the value is unfinished), in the order they appear; a key written twice keeps its
    first value (a later one would change what a stream already sent). ``end``: past the
    closing brace; None while the object is open, and for text that stops being an object
    (``broken``)."""

    fields: dict[str, tuple[int, int | None]]
    end: int | None
    broken: bool = False

    @property
    def done(self) -> bool:
        """Nothing after this point changes the scan."""
        return self.end is not None or self.broken


def scan_object(text: str, start: int) -> ObjectScan:
    """The object opening at ``text[start] == "{"``."""
    fields: dict[str, tuple[int, int | None]] = {}
    at = start + 1
    while True:
        head = _field_head(text, skip_space(text, at), fields)
        if isinstance(head, ObjectScan):
            return head
        key, value = head
        end = value_end(text, value)
        fields.setdefault(key, (value, end))
        if end is None:
            return ObjectScan(fields, None)
        at = end


def _field_head(text: str, at: int, fields: dict) -> tuple[str, int] | ObjectScan:
    """The next field's key and where its value starts, or how the scan ends at ``at``."""
    if text.startswith("}", at):
        return ObjectScan(fields, at + 1)
    if text.startswith(",", at) and fields:
        at = skip_space(text, at + 1)
    head = FIELD_HEAD.match(text, at)
    if head is None or head.end() == len(text):
        return ObjectScan(fields, None, broken=not _unfinished_head(text[at:]))
    try:
        return json.loads(head.group(1)), head.end()
    except ValueError:      # a key with a bad escape
        return ObjectScan(fields, None, broken=True)


def _unfinished_head(rest: str) -> bool:
    """Whether more text may still make ``rest`` a field's ``"key":`` (and its value)."""
    key = STRING.match(rest)
    if key is None:
        return rest[:1] in ("", '"')
    return UNTIL_VALUE.fullmatch(rest, key.end()) is not None
