"""``tool_choice`` of ``"required"`` or a named function, as a grammar: the reply is tool
calls in the chat format's own shape (the parser's: ``hermes``, ``llama3_json``,
``mistral``), each naming one of the tools and with arguments that validate against its
``parameters`` schema, so that what the parser reads back always holds.

The calls are llguidance's inline JSON Schemas (``%json``) in a Lark grammar; the name
comes first in each object, as the parsers stream it. Each tool's schema sits inside the
calls' schema, so its local references (``#/$defs/...``, which pydantic writes for a
nested model) are moved to where it sits (``_relocated``): resolved from the calls'
root, they named nothing and a tool that compiled alone was refused. Mistral's ``[TOOL_CALLS]`` is a
special token, named in the grammar by its id (``marker_id``) so that the model writes
the token it was trained on.
"""

import json
from collections.abc import Mapping, Sequence

from tokenspeed.errors import RefusedRequest
from tokenspeed.structured.grammar import JSON_DEFAULTS, compile_grammar
from tokenspeed.structured.spec import StructuredOutputs

ARGUMENT_KEY = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}


def _refuse(field: str, value: object, message: str) -> RefusedRequest:
    return RefusedRequest(f"{field}: {message}", field=field, value=value, limit=None)


def _functions(tools: Sequence[Mapping]) -> dict[str, dict]:
    """name -> parameters schema, each schema checked to compile."""
    functions = {}
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise _refuse("tools", tool, f"tool {index} has no function name")
        schema = function.get("parameters") or {"type": "object"}
        try:
            compile_grammar(StructuredOutputs(json=schema))
        except RefusedRequest as exc:
            raise _refuse("tools", schema, f"the parameters of {function['name']!r}: "
                          f"{str(exc).split(': ', 1)[1]}") from None
        functions[function["name"]] = dict(schema)
    return functions


NOT_SCHEMAS = frozenset({"const", "enum", "default", "examples"})   # values, kept as they are
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _relocated(schema: object, base: str) -> object:
    """``schema`` with each local ``$ref`` (``#`` or ``#/...``) made to point from ``base``,
    the JSON pointer of where the schema now sits. A schema with its own ``$id`` is a
    resource of its own, whose references already resolve within it."""
    if isinstance(schema, list):
        return [_relocated(s, base) for s in schema]
    if not isinstance(schema, dict) or "$id" in schema:
        return schema
    return {key: _rebased_keyword(key, value, base) for key, value in schema.items()}


def _rebased_keyword(key: str, value: object, base: str) -> object:
    if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
        return base + value[1:]
    if key in NOT_SCHEMAS:
        return value
    if key in SCHEMA_MAPS and isinstance(value, dict):   # names (any key at all) to schemas
        return {name: _relocated(s, base) for name, s in value.items()}
    return _relocated(value, base)


def _call_schema(functions: dict[str, dict], argument_key: str) -> str:
    calls = [{"type": "object",
              "properties": {"name": {"const": name},
                             argument_key: _relocated(schema, f"#/anyOf/{i}/properties/{argument_key}")},
              "required": ["name", argument_key], "additionalProperties": False}
             for i, (name, schema) in enumerate(functions.items())]
    return json.dumps({"x-guidance": JSON_DEFAULTS, "anyOf": calls})


def _lark(parser: str, call: str, many: bool, marker_id: int | None) -> str:
    """``start`` in the format's shape; ``body``: one call (``call``, an inline schema)."""
    separator = {"hermes": '"\\n"', "llama3_json": '"; "', "mistral": '", "'}[parser]
    item = "call" if parser == "hermes" else "body"
    items = f"{item} ({separator} {item})*" if many else item
    body = f"body: %json {call}"
    if parser == "hermes":
        return f'start: {items}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n{body}'
    if parser == "llama3_json":
        return f"start: {items}\n{body}"
    marker = f"<[{marker_id}]>" if marker_id is not None else '"[TOOL_CALLS]"'
    return f'start: {marker} "[" {items} "]"\n{body}'


def tool_choice_constraint(tools: Sequence[Mapping], tool_choice: str | Mapping, parser: str,
                           marker_id: int | None = None, parallel: bool = True) -> StructuredOutputs:
    """The constraint of ``tool_choice`` (``"required"``, or OpenAI's ``{"type": "function",
    "function": {"name": ...}}``) over ``tools`` (OpenAI's list) in ``parser``'s format;
    ``marker_id``: the id of Mistral's ``[TOOL_CALLS]`` token. ``"required"`` allows one
    call or more, one alone where not ``parallel`` (OpenAI's ``parallel_tool_calls``); a
    named function, one call."""
    if parser not in ARGUMENT_KEY:
        raise ValueError(f"parser={parser!r}: no tool-call grammar; choose one of {', '.join(ARGUMENT_KEY)}")
    functions = _functions(tools)
    if not functions:
        raise _refuse("tools", list(tools), f"tool_choice={tool_choice!r} needs at least one tool")
    if tool_choice != "required":
        name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, Mapping) else None
        if name not in functions:
            raise _refuse("tool_choice", tool_choice, f"names no tool of {sorted(functions)}")
        functions = {name: functions[name]}
    schema = _call_schema(functions, ARGUMENT_KEY[parser])
    return StructuredOutputs(grammar=_lark(parser, schema, tool_choice == "required" and parallel, marker_id))
