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
    while the value is unfinished). ``end``: past the closing brace; None while the object
    is open, and for text that stops being an object (``broken``)."""

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
        at = skip_space(text, at)
        if at == len(text):
            return ObjectScan(fields, None)
        if text[at] == "}":
            return ObjectScan(fields, at + 1)
        if text[at] == "," and fields:
            at = skip_space(text, at + 1)
        key = STRING.match(text, at)
        if at == len(text) or key is None:
            return ObjectScan(fields, None, broken=at < len(text) and text[at] != '"')
        colon = skip_space(text, key.end())
        if colon == len(text):
            return ObjectScan(fields, None)
        start_value = skip_space(text, colon + 1)
        if text[colon] != ":":
            return ObjectScan(fields, None, broken=True)
        if start_value == len(text):
            return ObjectScan(fields, None)
        end_value = value_end(text, start_value)
        try:
            fields[json.loads(key.group())] = (start_value, end_value)
        except ValueError:      # a key with a bad escape
            return ObjectScan(fields, None, broken=True)
        if end_value is None:
            return ObjectScan(fields, None)
        at = end_value
