"""OpenAI's ``response_format`` as a ``StructuredOutputs``: ``{"type": "text"}`` (no
constraint), ``{"type": "json_object"}`` (any JSON object) and ``{"type": "json_schema",
"json_schema": {"name", "schema", "strict"}}`` (what ``openai``'s
``chat.completions.parse(response_format=SomeModel)`` sends). The schema is held to
whether or not ``strict`` is set: a local engine has no reason to let output stray."""

from collections.abc import Mapping

from tokenspeed.errors import RefusedRequest
from tokenspeed.structured.spec import StructuredOutputs

TYPES = ("text", "json_object", "json_schema")


def _refuse(value: object, message: str) -> RefusedRequest:
    return RefusedRequest(f"response_format: {message}", field="response_format", value=value, limit=None)


def from_response_format(response_format: Mapping | None) -> StructuredOutputs | None:
    """The constraint ``response_format`` asks for, or None for plain text."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind not in TYPES:
        raise _refuse(response_format, f"type must be one of {', '.join(TYPES)}; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    spec = response_format.get("json_schema")
    if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
        raise _refuse(response_format, 'json_schema must be {"name": ..., "schema": {...}}')
    return StructuredOutputs(json=spec.get("schema") or {"type": "object"})
