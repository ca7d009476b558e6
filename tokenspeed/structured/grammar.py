"""A ``StructuredOutputs`` compiled to llguidance's grammar, checked where requests arrive.

Whatever is wrong with a schema, a regular expression or a grammar is found here, by
llguidance's own validator, and refused naming the field and llguidance's message: a
request that gets past the door compiles in the engine.

JSON whitespace is bounded (``JSON_WHITESPACE``): llguidance allows any run of it by
default, and a model sampled at a temperature can spend its whole ``max_tokens`` on one,
leaving text that does not parse. Up to 16 characters at each place JSON allows
whitespace keeps pretty-printed output (a newline and an indent) and ends every run.
A schema that sets its own whitespace (``whitespace_flexible`` or ``whitespace_pattern`` in
its top-level ``"x-guidance"``) keeps it.

A ``choice`` is one terminal, the alternation of its strings (``_choice_grammar``), not
llguidance's ``grammar_from("choice")``, a rule of one alternative per string: llguidance's
parser holds at most 2,000 items in a row, so a choice of more strings compiled, then
failed at its first token, mid-stream.
"""

import json

import attrs
import llguidance

from tokenspeed.errors import RefusedRequest
from tokenspeed.structured.spec import StructuredOutputs

JSON_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"
JSON_DEFAULTS = {"whitespace_pattern": JSON_WHITESPACE}
ANY_OBJECT = '{"type": "object"}'
WHITESPACE_OPTIONS = {"whitespace_flexible", "whitespace_pattern"}


@attrs.frozen
class Grammar:
    """``text``: llguidance's grammar (what ``LLMatcher`` takes); ``spec``: what it came from."""

    spec: StructuredOutputs
    text: str = attrs.field(repr=False)


def _refuse(spec: StructuredOutputs, message: str) -> RefusedRequest:
    value = getattr(spec, spec.kind)
    return RefusedRequest(f"structured_outputs.{spec.kind}: {message}",
                          field=f"structured_outputs.{spec.kind}", value=value, limit=None)


def _schema(spec: StructuredOutputs, text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _refuse(spec, f"not valid JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise _refuse(spec, f"a JSON Schema is an object or a boolean, not {type(schema).__name__}")
    if schema is False:
        raise _refuse(spec, "the schema false allows no value")
    schema = {} if schema is True else schema   # any value: llguidance takes the object form
    own = schema.get("x-guidance")
    chosen = isinstance(own, dict) and WHITESPACE_OPTIONS & own.keys()
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=None if chosen else JSON_DEFAULTS)
    except ValueError as exc:   # a value llguidance cannot take (an integer past 64 bits)
        raise _refuse(spec, str(exc)) from None


def _grammar_text(spec: StructuredOutputs) -> str:
    if spec.kind == "json":
        return _schema(spec, spec.json)
    if spec.kind == "json_object":
        return _schema(spec, ANY_OBJECT)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.kind == "choice":
        return _choice_grammar(spec.choice)
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:   # GBNF that does not convert to Lark
        raise _refuse(spec, f"{exc} (a grammar without a start rule is read as GBNF: Lark starts from "
                            f"'start: ...', GBNF from 'root ::= ...')") from None


def _choice_grammar(choices: tuple[str, ...]) -> str:
    """One lexeme matching exactly one of ``choices``: the lexer's automaton takes any number
    of strings, where a rule's alternatives each take an item of the parser's row. Each
    string is a Lark literal in JSON's quoting, which llguidance's Lark reads."""
    return f"start: CHOICE\nCHOICE: {' | '.join(json.dumps(c) for c in choices)}"


def compile_grammar(spec: StructuredOutputs,
                    tokenizer: llguidance.LLTokenizer | None = None) -> Grammar:
    """``spec`` as llguidance's grammar, refused with llguidance's message if it does not
    compile. With the model's ``tokenizer`` (``guidance_tokenizer``) the check also covers
    what depends on the vocabulary (special tokens a grammar names), and a grammar that no
    text satisfies (``[^\\s\\S]``): its first mask leaves llguidance's matcher in error, where
    the engine would end the request at once with nothing."""
    text = _grammar_text(spec)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
    if failed:
        raise _refuse(spec, messages[0].strip())
    if tokenizer is not None:
        _check_satisfiable(spec, text, tokenizer)
    return Grammar(spec, text)


def error_line(matcher: llguidance.LLMatcher) -> str:
    """The first line of a matcher's error: the rest is llguidance's dump of the parser's
    state, not for clients."""
    return (matcher.get_error().splitlines() or ["no message"])[0]


def _check_satisfiable(spec: StructuredOutputs, text: str, tokenizer: llguidance.LLTokenizer) -> None:
    matcher = llguidance.LLMatcher(tokenizer, text, log_level=0)
    matcher.compute_bitmask()
    if matcher.is_error():
        raise _refuse(spec, f"no text satisfies it ({error_line(matcher)})")
