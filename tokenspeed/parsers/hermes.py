"""Hermes-style tool calls (Qwen2.5, Qwen3 and many fine-tunes): each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``; the
content is the text before the first call."""

from tokenspeed.parsers.json_scan import scan_object, skip_space
from tokenspeed.parsers.tool_scan import (CallScan, ToolParser, ToolScan, call_of, shown_content,
                                          with_content_fallback)

START, END = "<tool_call>", "</tool_call>"


def _calls(text: str) -> list[CallScan]:
    calls, at = [], text.find(START)
    while at >= 0:
        body = skip_space(text, at + len(START))
        if body == len(text):
            break
        if text[body] == "{":
            scan = scan_object(text, body)
            call = call_of(text, scan)
            calls += [call] if call else []
            if not scan.done:
                break
        close = text.find(END, body)
        at = text.find(START, close + len(END)) if close >= 0 else -1
    return calls


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> ToolScan:
        scan = ToolScan(shown_content(text, START, final), tuple(_calls(text)))
        return with_content_fallback(text, scan, final)
