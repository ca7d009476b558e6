"""Mistral tool calls after ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}``
objects (tokenizer v3 and earlier), or ``name[ARGS]{...}`` per call (v11 and later, each
call opened by its own ``[TOOL_CALLS]``). The content is the text before the first call.
Call ids are nine letters and digits, as Mistral's templates require.

``[TOOL_CALLS]`` and ``[ARGS]`` are special tokens: the reply must be detokenized with
``skip_special_tokens=False`` for them to reach the parser.
"""

import uuid

from tokenspeed.parsers.json_scan import scan_object, skip_space, value_end
from tokenspeed.parsers.tool_scan import (CallScan, ToolParser, ToolScan, argument_text, call_of,
                                          shown_content, with_content_fallback)

START, ARGS = "[TOOL_CALLS]", "[ARGS]"


def _array_calls(text: str, at: int) -> list[CallScan]:
    calls = []
    while True:
        at = skip_space(text, at + 1)
        if at == len(text) or text[at] != "{":
            return calls
        scan = scan_object(text, at)
        call = call_of(text, scan)
        calls += [call] if call else []
        if scan.end is None:
            return calls
        at = skip_space(text, scan.end)
        if not text.startswith(",", at):
            return calls


def _named_call(text: str, at: int) -> tuple[CallScan | None, int | None]:
    """One ``name[ARGS]{...}`` call from ``at``, and where its text ends (None: unfinished)."""
    args = text.find(ARGS, at)
    if args < 0:
        return None, None
    name, start = text[at:args].strip(), skip_space(text, args + len(ARGS))
    if start == len(text):
        return (CallScan(name, "") if name else None), None
    end = value_end(text, start)
    return (CallScan(name, argument_text(text, start, end)) if name else None), end


def _calls(text: str) -> list[CallScan]:
    calls, at = [], text.find(START)
    while at >= 0:
        body = skip_space(text, at + len(START))
        if body == len(text):
            return calls
        if text[body] == "[":
            return calls + _array_calls(text, body)
        call, end = _named_call(text, body)
        calls += [call] if call else []
        at = text.find(START, end) if end is not None else -1
    return calls


def mistral_call_id() -> str:
    return uuid.uuid4().hex[:9]


class MistralToolParser(ToolParser):
    name = "mistral"

    def __init__(self, new_id=mistral_call_id):
        super().__init__(new_id)

    def scan(self, text: str, final: bool) -> ToolScan:
        scan = ToolScan(shown_content(text, START, final), tuple(_calls(text)))
        return with_content_fallback(text, scan, final)
