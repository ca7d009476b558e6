"""What a conversation may hold, checked once for ``LLM.chat`` and the server alike, so a
message one accepts the other does not refuse.

A message is a dict with a ``role`` (system, user, assistant, developer, tool), a
``content`` (a string or a list of ``{"type": "text", "text": ...}`` parts; an assistant's
may be None) and optionally a ``name``. An assistant message may carry the ``tool_calls``
it made (OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``) and
the ``reasoning_content`` it thought; a tool message, the ``tool_call_id`` it answers. The
template sees the content as one string (text parts joined by newlines, as vLLM joins
them), a developer message as a system one, the other fields where given (transformers
passes them on likewise), and each call's ``arguments`` as a dict: the JSON text OpenAI
sends, parsed, as tool-calling templates expect them (vLLM parses them likewise).

An assistant message as OpenAI's client returns it (``message.model_dump()``) goes back
in as it is: its ``refusal`` stands for the content when there is none, and its
``annotations`` are dropped; ``audio`` and the deprecated ``function_call`` are refused
unless null (a text model wrote neither).
"""

import json
from collections.abc import Mapping, Sequence

from tokenspeed.api.prompts import unicode_text

ROLES = ("system", "user", "assistant", "developer", "tool")
MEDIA_PARTS = ("image_url", "input_audio", "video_url", "audio_url", "file")   # OpenAI's and vLLM's
FIELDS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal",
          "annotations", "audio", "function_call")
NULL_ONLY = {"audio": "audio output (a text model writes none)",
             "function_call": "function_call (deprecated by OpenAI: send tool_calls)"}
OWN_VARIABLES = ("messages", "tools", "add_generation_prompt")   # the template's, set by their arguments
ROLE_OF_FIELD = {"tool_calls": "assistant", "reasoning_content": "assistant", "tool_call_id": "tool",
                 "refusal": "assistant", "annotations": "assistant"}
CALL_FIELDS = ("id", "type", "function")


def conversations(messages) -> list[list[dict]]:
    """``LLM.chat``'s argument as checked conversations: one conversation (a list of
    messages) or a list of them."""
    if not _is_list(messages) or not messages:
        raise TypeError(f"messages must be a list of message dicts (one conversation) or a list "
                        f"of such lists, got {_shown(messages)}")
    if all(_is_list(c) for c in messages):
        return [template_messages(c, f"messages[{i}]") for i, c in enumerate(messages)]
    return [template_messages(messages, "messages")]


def template_variables(tools=None, chat_template_kwargs=None) -> dict:
    """The chat template's further variables: ``chat_template_kwargs`` and the ``tools``
    (dicts, as transformers passes them on). The template's own variables are set by
    their own arguments, never through ``chat_template_kwargs``."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(f"chat_template_kwargs must be a dict, got {_shown(chat_template_kwargs)}")
    if tools is not None and not (_is_list(tools) and all(isinstance(t, Mapping) for t in tools)):
        raise TypeError(f"tools must be a list of tool dicts, got {_shown(tools)}")
    variables = dict(chat_template_kwargs or {})
    clash = sorted(set(variables) & set(OWN_VARIABLES))
    if clash:
        raise ValueError(f"chat_template_kwargs: {clash} are set by the request's own fields "
                         f"({', '.join(OWN_VARIABLES)}), not here")
    if tools:
        variables["tools"] = list(tools)
    return variables


def template_messages(messages, where: str = "messages") -> list[dict]:
    """One conversation, checked, as the chat template takes it."""
    if not _is_list(messages) or not messages:
        raise TypeError(f"{where} must be a non-empty list of message dicts, got {_shown(messages)}")
    return [_message(m, f"{where}[{i}]") for i, m in enumerate(messages)]


def _message(message, where: str) -> dict:
    if not isinstance(message, Mapping):
        raise TypeError(f"{where} must be a dict with 'role' and 'content', got {_shown(message)}")
    unknown = sorted(set(message) - set(FIELDS), key=str)
    if unknown:
        taken = ", ".join(f for f in FIELDS if f not in NULL_ONLY)
        raise ValueError(f"{where} has unknown field(s) {unknown}: a message takes {taken} (and "
                         f"{' and '.join(NULL_ONLY)} as null)")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role={role!r}: must be one of {', '.join(ROLES)}")
    if message.get("content") is None and role != "assistant":   # only a call or a refusal may be all there is
        raise ValueError(f"{where}.content: a {role} message needs content (a string or text parts)")
    for field, what in NULL_ONLY.items():
        if message.get(field) is not None:
            raise ValueError(f"{where}.{field}={_shown(message[field])}: {what} is not supported; only null "
                             f"is accepted")
    content = _refusal_as_content(message, role, where)
    out = {"role": "system" if role == "developer" else role, "content": _content(content, f"{where}.content")}
    for field in ("name", "tool_call_id", "reasoning_content"):
        if message.get(field) is not None:
            out[field] = _string(message[field], role, field, where)
    if message.get("annotations") is not None:
        _check_role(role, "annotations", where)
        if not _is_list(message["annotations"]):
            raise TypeError(f"{where}.annotations must be a list, got {_shown(message['annotations'])}")
    if message.get("tool_calls") is not None:
        _check_role(role, "tool_calls", where)
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return out


def _refusal_as_content(message: Mapping, role: str, where: str):
    """The content, or the refusal an assistant gave instead of one (never both: which would
    the template show?)."""
    refusal, content = message.get("refusal"), message.get("content")
    if refusal is None:
        return content
    refusal = _string(refusal, role, "refusal", where)
    if content is not None:
        raise ValueError(f"{where} has both content and a refusal ({_shown(refusal)}): give one")
    return refusal


def _string(value, role: str, field: str, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}.{field}={value!r}: must be a string")
    _check_role(role, field, where)
    return value


def _check_role(role: str, field: str, where: str) -> None:
    wanted = ROLE_OF_FIELD.get(field)
    if wanted is not None and role != wanted:
        raise ValueError(f"{where}.{field}: only a message of role {wanted!r} has one, not one of role {role!r}")


def _tool_calls(calls, where: str) -> list[dict]:
    if not _is_list(calls):
        raise TypeError(f"{where} must be a list of tool calls, got {_shown(calls)}")
    return [_tool_call(c, f"{where}[{i}]") for i, c in enumerate(calls)]


def _tool_call(call, where: str) -> dict:
    """``{"id"?, "type": "function", "function": {"name", "arguments"}}``, its arguments as a dict."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) \
            or set(call) - set(CALL_FIELDS) or call.get("type", "function") != "function":
        raise ValueError(f"{where} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                         f"'arguments': str}}}}, got {_shown(call)}")
    out = {"type": "function", "function": {"name": function["name"],
                                            "arguments": _arguments(function.get("arguments"), where)}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _arguments(arguments, where: str) -> dict:
    """The JSON text of a call's arguments (or the dict itself), as a dict; none: ``{}``."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    if arguments is None or arguments == "":
        return {}
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}.function.arguments is not JSON ({exc}): {_shown(arguments)}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{where}.function.arguments must be a JSON object, got {_shown(arguments)}")
    return parsed


def _content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return unicode_text(content or "", where)
    if not _is_list(content):
        raise TypeError(f"{where} must be a string or a list of text parts, got {_shown(content)}")
    return "\n".join(unicode_text(_text_part(p, f"{where}[{i}]"), f"{where}[{i}]") for i, p in enumerate(content))


def _text_part(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind in MEDIA_PARTS:
        raise ValueError(f"{where} is an {kind!r} part: the models served here read text alone")
    if not isinstance(part, Mapping) or kind != "text" or set(part) != {"type", "text"} \
            or not isinstance(part["text"], str):
        raise ValueError(f"{where} must be {{'type': 'text', 'text': str}}, got {_shown(part)}")
    return part["text"]


def _is_list(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, Mapping))


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
