"""Tool-call and reasoning parsers: a model's reply text as OpenAI's message (content,
``tool_calls``, ``reasoning_content``), whole or as stream deltas that join to the whole.

Pure text in, records out: nothing of the engine, the server or the tokenizer is imported,
so the server chains them as it likes (reasoning first, its content into the tool parser).
"""

from tokenspeed.parsers.reasoning import ReasoningStream, ThinkParser
from tokenspeed.parsers.records import DeltaMessage, ParsedReply, ToolCall, ToolCallDelta
from tokenspeed.parsers.registry import (REASONING_PARSERS, TOOL_PARSERS, default_reasoning_parser,
                                         default_tool_parser, reasoning_parser, tool_parser)
from tokenspeed.parsers.tool_scan import ToolCallStream, ToolParser

__all__ = [
    "DeltaMessage", "ParsedReply", "REASONING_PARSERS", "ReasoningStream", "TOOL_PARSERS", "ThinkParser",
    "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolParser", "default_reasoning_parser",
    "default_tool_parser", "reasoning_parser", "tool_parser",
]
