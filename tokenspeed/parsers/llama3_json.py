"""Llama 3.x JSON tool calls: a reply that is (after an optional ``<|python_tag|>``) one
or more objects ``{"name": ..., "parameters": {...}}`` separated by ``;``. A reply that
opens with anything else is content."""

from tokenspeed.parsers.json_scan import scan_object, skip_space
from tokenspeed.parsers.tool_scan import CallScan, ToolParser, ToolScan, call_of, with_content_fallback

PYTHON_TAG = "<|python_tag|>"


def _start(text: str, final: bool) -> int | None:
    """Where the first object opens; -1 for a reply of content; None while undecided."""
    at = skip_space(text, 0)
    if not final and PYTHON_TAG.startswith(text[at:]):
        return None
    if text.startswith(PYTHON_TAG, at):
        at = skip_space(text, at + len(PYTHON_TAG))
        if at == len(text) and not final:
            return None
    return at if at < len(text) and text[at] == "{" else -1


def _calls(text: str, at: int) -> list[CallScan]:
    calls = []
    while at < len(text) and text[at] == "{":
        scan = scan_object(text, at)
        call = call_of(text, scan)
        calls += [call] if call else []
        if scan.end is None:
            break
        at = skip_space(text, scan.end)
        if not text.startswith(";", at):
            break
        at = skip_space(text, at + 1)
    return calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> ToolScan:
        start = _start(text, final)
        if start is None:
            return ToolScan("")
        if start < 0:
            return ToolScan(text)
        return with_content_fallback(text, ToolScan("", tuple(_calls(text, start))), final)
