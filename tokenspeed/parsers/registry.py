"""The parsers by the names ``--tool-call-parser`` and ``--reasoning-parser`` take (vLLM's
names), and the default a chat template implies where its text shows the format."""

from collections.abc import Callable
from types import MappingProxyType

from tokenspeed.parsers.hermes import HermesToolParser
from tokenspeed.parsers.llama3_json import Llama3JsonToolParser
from tokenspeed.parsers.mistral import MistralToolParser
from tokenspeed.parsers.reasoning import ThinkParser
from tokenspeed.parsers.tool_scan import ToolParser

TOOL_PARSERS = MappingProxyType({parser.name: parser for parser in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser)})
REASONING_PARSERS = MappingProxyType({parser.name: parser for parser in (
    ThinkParser("qwen3", starts_in_reasoning=False), ThinkParser("deepseek_r1", starts_in_reasoning=True))})

# What a template writes when it teaches the model a format, in the order they are tried.
TOOL_FORMAT_SIGNS = (("hermes", ("<tool_call>",)), ("mistral", ("[TOOL_CALLS]",)),
                     ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name')))


def _unknown(flag: str, name: str, names) -> ValueError:
    return ValueError(f"{flag}={name!r}: unknown; choose one of {', '.join(sorted(names))}")


def tool_parser(name: str, new_id: Callable[[], str] | None = None) -> ToolParser:
    """The tool-call parser called ``name``; ``new_id``: its call ids (the format's own by default)."""
    if name not in TOOL_PARSERS:
        raise _unknown("--tool-call-parser", name, TOOL_PARSERS)
    return TOOL_PARSERS[name]() if new_id is None else TOOL_PARSERS[name](new_id)


def reasoning_parser(name: str) -> ThinkParser:
    if name not in REASONING_PARSERS:
        raise _unknown("--reasoning-parser", name, REASONING_PARSERS)
    return REASONING_PARSERS[name]


def default_tool_parser(chat_template: str | None) -> str | None:
    """The tool-call format a chat template's text teaches, or None when it shows none."""
    template = chat_template or ""
    return next((name for name, signs in TOOL_FORMAT_SIGNS if any(s in template for s in signs)), None)


def default_reasoning_parser(chat_template: str | None) -> str | None:
    """``qwen3`` for a template with a thinking switch (the model opens ``<think>`` itself),
    ``deepseek_r1`` for one that opens the thought in the prompt, None without ``<think>``."""
    template = chat_template or ""
    if "<think>" not in template:
        return None
    return "qwen3" if "enable_thinking" in template else "deepseek_r1"
