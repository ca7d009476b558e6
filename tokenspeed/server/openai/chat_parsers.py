"""Which parsers read a served model's replies: the tool-call format (``--tool-call-parser``)
and the reasoning format (``--reasoning-parser``), by vLLM's names. A flag left out takes
the format the chat template teaches, where its text shows one (``default_tool_parser``,
``default_reasoning_parser``); ``none`` turns a parser off."""

import attrs

from tokenspeed.parsers import default_reasoning_parser, default_tool_parser, reasoning_parser, tool_parser

OFF = "none"


def _check_tool_parser(instance, attribute, value):
    if value is not None and value != OFF:
        tool_parser(value)   # an unknown name is refused, naming the flag and the choices


def _check_reasoning_parser(instance, attribute, value):
    if value is not None and value != OFF:
        reasoning_parser(value)


@attrs.frozen
class ParserFlags:
    """The flags as given: a parser's name, ``"none"``, or None (the chat template's)."""

    tool_call_parser: str | None = attrs.field(default=None, validator=_check_tool_parser)
    reasoning_parser: str | None = attrs.field(default=None, validator=_check_reasoning_parser)

    def resolve(self, chat_template: str | None) -> "ChatParsers":
        return ChatParsers(_chosen(self.tool_call_parser, default_tool_parser(chat_template)),
                           _chosen(self.reasoning_parser, default_reasoning_parser(chat_template)))


def _chosen(flag: str | None, default: str | None) -> str | None:
    return default if flag is None else None if flag == OFF else flag


@attrs.frozen
class ChatParsers:
    """The parsers a server uses, by name (None: replies are not parsed that way)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
