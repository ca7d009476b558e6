"""What a conversation may hold, checked once for ``LLM.chat`` and the server alike, so a
message one accepts the other does not refuse.

A message is a dict with a ``role`` (system, user, assistant, developer, tool), a
``content`` (a string, a list of ``{"type": "text", "text": ...}`` parts, or None) and
optionally a ``name``. The template sees the content as one string, a developer message
as a system one, and the ``name`` where given (transformers passes it on likewise).
"""

from collections.abc import Mapping, Sequence

ROLES = ("system", "user", "assistant", "developer", "tool")
FIELDS = ("role", "content", "name")


def conversations(messages) -> list[list[dict]]:
    """``LLM.chat``'s argument as checked conversations: one conversation (a list of
    messages) or a list of them."""
    if not _is_list(messages) or not messages:
        raise TypeError(f"messages must be a list of message dicts (one conversation) or a list "
                        f"of such lists, got {_shown(messages)}")
    if all(_is_list(c) for c in messages):
        return [template_messages(c, f"messages[{i}]") for i, c in enumerate(messages)]
    return [template_messages(messages, "messages")]


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
        raise ValueError(f"{where} has unknown field(s) {unknown}: a message takes {', '.join(FIELDS)}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where}.role={role!r}: must be one of {', '.join(ROLES)}")
    out = {"role": "system" if role == "developer" else role,
           "content": _content(message.get("content"), f"{where}.content")}
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise TypeError(f"{where}.name={message['name']!r}: must be a string")
        out["name"] = message["name"]
    return out


def _content(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not _is_list(content):
        raise TypeError(f"{where} must be a string or a list of text parts, got {_shown(content)}")
    return "".join(_text_part(p, f"{where}[{i}]") for i, p in enumerate(content))


def _text_part(part, where: str) -> str:
    if not isinstance(part, Mapping) or part.get("type") != "text" or set(part) != {"type", "text"} \
            or not isinstance(part["text"], str):
        raise ValueError(f"{where} must be {{'type': 'text', 'text': str}}, got {_shown(part)}")
    return part["text"]


def _is_list(value) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, Mapping))


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"
