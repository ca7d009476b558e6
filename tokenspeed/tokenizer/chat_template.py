"""Chat templates rendered with jinja2 the way transformers renders them.

A model's chat template is written against transformers' jinja environment: a sandbox
with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``strftime_now``, a
``tojson`` that does not HTML-escape, ``{% break %}``/``{% continue %}`` and the
``{% generation %}`` tag. Anything less and the same template renders different text
(or fails), so this module rebuilds that environment.
"""

import json
import warnings
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs
import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class NoChatTemplateError(ValueError):
    """The model ships no chat template, so a conversation cannot be turned into a prompt."""


class ChatTemplateRefusal(ValueError):
    """A chat template (``chat_template``) or a continuation (``continue_final_message``)
    that cannot be: ``field`` names the argument, for a server to name the request's field
    (the tokenizer imports nothing of the engine, so not a ``RefusedRequest``)."""

    def __init__(self, field: str, why: str):
        super().__init__(f"{field}: {why}")
        self.field = field


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    Training templates mark the assistant's text with it (transformers uses the marks
    to build an assistant-token mask). Serving needs no mask, but without a parser
    for the tag such a template does not compile at all.
    """

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)  # a scope, as transformers' call block has


class TemplateFailed(ChatTemplateRefusal, jinja2.TemplateError):
    """A render that failed: the template rejected the conversation (``raise_exception``,
    ``field`` "messages") or its own code failed (an undefined name, a division by zero,
    ``field`` "chat_template"). A ``jinja2.TemplateError`` as transformers raises, and a
    ``ValueError`` as every other refusal here, so a caller shows one line, not a traceback."""


class _Rejected(jinja2.TemplateError):
    """What ``raise_exception`` raises inside a render."""


def _raise_exception(message: str):
    """Templates call this to reject a conversation they cannot render (e.g. bad roles)."""
    raise _Rejected(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson``: plain ``json.dumps``; jinja's own escapes ``<>&'``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """Templates (Llama 3.x) stamp today's date into the system prompt with this."""
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    """A fresh environment per template: no state is shared between tokenizers."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _without_none(message: Mapping[str, Any]) -> dict[str, Any]:
    """Drop ``key: None`` as transformers does: templates test for a key, not for None."""
    return {key: value for key, value in message.items() if value is not None}


def _not_a_template(exc: jinja2.TemplateSyntaxError) -> str:
    return f"not a Jinja template (line {exc.lineno}: {exc.message})"


@attrs.frozen
class ChatTemplate:
    """A compiled chat template; ``source`` is the jinja text it came from. A model's
    template that does not parse has no ``template``: ``problem`` says why, naming the file
    it came from, and every render is refused with it (see ``of_model``)."""

    source: str
    template: jinja2.Template | None = attrs.field(eq=False, repr=False)
    problem: str | None = attrs.field(default=None, eq=False)

    @classmethod
    def compile(cls, source: str) -> "ChatTemplate":
        """``source`` compiled; a template that does not parse is refused naming the line."""
        try:
            return cls(source, _environment().from_string(source))
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateRefusal("chat_template", _not_a_template(exc)) from None

    @classmethod
    def of_model(cls, source: str, origin: str) -> "ChatTemplate":
        """A model's template, read from ``origin`` (a file, a GGUF key). One that does not
        parse is kept, with a warning now, and refused naming ``origin`` when a conversation
        is rendered: plain prompts never need it (vLLM too fails only at chat time)."""
        try:
            return cls(source, _environment().from_string(source))
        except jinja2.TemplateSyntaxError as exc:
            problem = f"{origin}: {_not_a_template(exc)}"
            warnings.warn(f"{problem}; conversations will be refused until a chat_template is passed",
                          stacklevel=3)
            return cls(source, None, problem)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               special_tokens: Mapping[str, str], **kwargs) -> str:
        """The prompt text for one conversation.

        ``special_tokens`` are the ``bos_token``-style variables; ``kwargs`` reach the
        template as further variables (``tools``, ``documents``, ``enable_thinking``, ...)
        and override the special tokens, as in transformers.
        """
        if self.template is None:
            raise ChatTemplateRefusal("chat_template", f"the model's chat template cannot be used: {self.problem}")
        variables = {"tools": None, "documents": None, **special_tokens, **kwargs}
        try:
            return self.template.render(messages=[_without_none(m) for m in messages],
                                        add_generation_prompt=add_generation_prompt, **variables)
        except _Rejected as exc:
            raise TemplateFailed("messages", exc.message) from None
        except Exception as exc:   # the template's own code: any error of it is the template's
            raise TemplateFailed("chat_template", f"rendering failed: {type(exc).__name__}: {exc}") from None


def continued(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` (a conversation rendered without a generation prompt) cut after the last
    message's content, so the model goes on writing that message (transformers'
    ``continue_final_message``: a template that strips contents is matched stripped)."""
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise _cannot_continue("the last message has no text to continue")
    for content in (final, final.strip()):
        at = text.rfind(content)
        if at >= 0:
            return text[:at + len(content)]
    raise _cannot_continue("the chat template does not write the last message's content as it is, so the "
                           "prompt cannot end inside it")


def _cannot_continue(why: str) -> ChatTemplateRefusal:
    return ChatTemplateRefusal("continue_final_message", why)
