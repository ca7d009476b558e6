"""``StructuredOutputs``: what a request's output must match, with vLLM's field names.

Exactly one kind of constraint is set: ``json`` (a JSON Schema, as a dict or its text),
``regex``, ``choice`` (one of a list of strings), ``grammar`` (Lark, or llama.cpp's GBNF)
or ``json_object`` (any JSON object). The record checks its shape only; whether the
schema, expression or grammar compiles is ``compile_grammar``'s to say, at the door.
"""

import json
from collections.abc import Iterable, Mapping

import attrs

from tokenspeed.errors import RefusedRequest

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _refuse(name: str, value: object, message: str) -> RefusedRequest:
    return RefusedRequest(f"structured_outputs.{name}={value!r}: {message}",
                          field=f"structured_outputs.{name}", value=value, limit=None)


def _schema_text(value: object) -> str | None:
    """A schema given as a dict is kept as its JSON text: the record stays hashable and
    crosses processes as a string."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        return json.dumps(value)
    raise _refuse("json", value, "must be a JSON Schema: a dict or its JSON text")


def _choices(value: object) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(c, str) for c in value):
        raise _refuse("choice", value, "must be a list of strings")
    return tuple(value)


def _check_text(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value):
        raise _refuse(attribute.name, value, "must be a non-empty string")


def _check_choice(instance, attribute, value):
    if value is not None and (not value or not all(value)):
        raise _refuse("choice", list(value), "must hold at least one string, none of them empty")


def _check_json_object(instance, attribute, value):
    if not isinstance(value, bool):
        raise _refuse("json_object", value, "must be True or False")


@attrs.frozen
class StructuredOutputs:
    """One constraint on a request's output. ``json`` holds the schema's JSON text."""

    json: str | None = attrs.field(default=None, converter=_schema_text, validator=_check_text)
    regex: str | None = attrs.field(default=None, validator=_check_text)
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices,
                                                 validator=_check_choice)
    grammar: str | None = attrs.field(default=None, validator=_check_text)
    json_object: bool = attrs.field(default=False, validator=_check_json_object)

    def __attrs_post_init__(self):
        chosen = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(chosen) != 1:
            given = ", ".join(chosen) if chosen else "none"
            raise RefusedRequest(f"structured_outputs: set exactly one of {', '.join(KINDS)}; "
                                 f"got {given}", field="structured_outputs",
                                 value=chosen, limit=1)

    @property
    def kind(self) -> str:
        """The name of the one field set."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))
