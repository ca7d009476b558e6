"""How a chat request's tools are served. The tools always reach the chat template;
``tool_choice`` then says what becomes of the reply: ``"none"`` leaves it text (vLLM's
default), ``"auto"`` (the default with tools) parses the calls the model writes, and
``"required"`` or a named function also holds the reply to calls of those tools, with
arguments valid for their schemas, by a grammar in the parser's format
(``tool_choice_constraint``). ``parallel_tool_calls: false`` allows one call: the grammar
of a required call takes one, and a reply parsed for calls keeps its first (as vLLM keeps
it). ``"auto"`` reads calls in the format the model was taught, so it needs a tool-call
parser (``ChatParsers``) and is refused on a server with none; a required or named call
does not, as in vLLM: where no parser is set, its grammar holds the reply to plain JSON
calls (``JSON_CALLS``, Llama 3's ``{"name": ..., "parameters": ...}`` objects), which that
format's parser reads back."""

import attrs

from tokenspeed.errors import RefusedRequest
from tokenspeed.server.openai.api_error import APIError
from tokenspeed.server.openai.chat_parsers import ChatParsers
from tokenspeed.server.openai.grammar_check import Constraint
from tokenspeed.structured import tool_choice_constraint

MISTRAL_MARKER = "[TOOL_CALLS]"
JSON_CALLS = "llama3_json"   # the calls' format where a required or named call meets no parser


@attrs.frozen
class ToolUse:
    """``parser``: the format the reply's calls are read in (None: the reply is text);
    ``constraint``: the grammar of a required or named call; ``single``: one call at most
    (``parallel_tool_calls: false``)."""

    parser: str | None = None
    constraint: Constraint | None = None
    single: bool = False


def tool_use(request, parsers: ChatParsers, tokenizer) -> ToolUse:
    """``request``'s ``tools`` and ``tool_choice`` served by ``parsers`` (compiles the tools'
    schemas for a required or named call: call it off the event loop)."""
    choice = request.tool_choice
    if choice not in (None, "none") and not request.tools:
        raise APIError(400, f"tool_choice={_shown(choice)} needs tools", "tool_choice")
    if not request.tools or choice == "none":
        return ToolUse()
    parser, single = parsers.tool_call_parser, request.parallel_tool_calls is False
    if choice in (None, "auto"):
        if parser is None:
            raise APIError(400, "tools: tool_choice='auto' (the default with tools) reads the calls a model writes, "
                           "and this server has no tool-call parser (its chat template shows no tool-call format): "
                           "start it with --tool-call-parser, or send tool_choice 'none', 'required' or a named "
                           "function", "tools")
        return ToolUse(parser, single=single)
    parser = parser or JSON_CALLS
    return ToolUse(parser, Constraint(_constraint(request, parser, tokenizer, not single), "tool_choice"), single)


def _constraint(request, parser: str, tokenizer, parallel: bool):
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    choice = request.tool_choice if isinstance(request.tool_choice, str) else request.tool_choice.model_dump()
    try:
        return tool_choice_constraint(tools, choice, parser, _marker_id(tokenizer) if parser == "mistral" else None,
                                      parallel)
    except RefusedRequest as exc:
        raise APIError(400, str(exc), exc.field) from exc


def _marker_id(tokenizer) -> int | None:
    """The id of Mistral's ``[TOOL_CALLS]`` where the vocabulary holds it as a special token."""
    ids = tokenizer.encode(MISTRAL_MARKER, add_special_tokens=False)
    return ids[0] if len(ids) == 1 and ids[0] in tokenizer.special_token_ids else None


def _shown(choice) -> str:
    return repr(choice) if isinstance(choice, str) else repr(choice.model_dump())
