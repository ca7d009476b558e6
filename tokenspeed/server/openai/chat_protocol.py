"""The chat request bodies (``/v1/chat/completions``, and ``/tokenize`` given messages),
checked as strictly as ``protocol``'s: the messages (with the calls an assistant made and
the tools' answers), the ``tools`` and ``tool_choice``, and ``chat_template_kwargs``,
further variables for the chat template (``enable_thinking: false``, say), as vLLM
passes them. The template's own variables (``messages``, ``tools``,
``add_generation_prompt``) are set by their fields, not through ``chat_template_kwargs``.
"""

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenspeed.api.chat_messages import MEDIA_PARTS, ROLES, template_messages, template_variables
from tokenspeed.execution.sampling_params import MAX_LOGPROBS
from tokenspeed.server.openai.api_error import APIError
from tokenspeed.server.openai.protocol import SamplingFields, Strict

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"   # OpenAI's rule: a name the model writes back, and parsers find


class TextPart(Strict):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio or file part: read only to be refused by its kind (``chat_messages``),
    not as a body that fails to parse."""
    model_config = ConfigDict(extra="allow")
    type: Literal[MEDIA_PARTS]


class FunctionCall(Strict):
    name: str
    arguments: str | dict


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal[ROLES]
    content: str | list[Annotated[TextPart | MediaPart, Field(discriminator="type")]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None             # OpenAI's assistant message, as its client returns it
    annotations: list | None = None
    audio: dict | None = None              # refused unless null (``chat_messages``)
    function_call: dict | None = None

    def as_template_message(self) -> dict:
        """Shaped by the check ``LLM.chat`` makes (``chat_messages``): one rule for both."""
        return template_messages([self.model_dump(exclude_none=True)])[0]


class FunctionDefinition(Strict):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(Strict):
    """What the chat template sees: the conversation, the tools and further variables."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False     # vLLM's: the reply goes on from the last message
    chat_template: str | None = None         # vLLM's: a Jinja template instead of the model's
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None

    def checked_messages(self) -> list[dict]:
        """The messages as the template takes them, refused (400) as ``LLM.chat`` refuses them."""
        try:
            return template_messages([m.model_dump(exclude_none=True) for m in self.messages])
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc), "messages") from exc

    def template_variables(self) -> dict:
        """``tools`` (as the client sent them: transformers passes dicts on unchanged) and
        ``chat_template_kwargs``."""
        if self.tools:
            self._check_tool_names()
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        try:
            return template_variables(tools, self.chat_template_kwargs)
        except ValueError as exc:
            raise APIError(400, str(exc), "chat_template_kwargs") from exc

    def _check_tool_names(self) -> None:
        """Two tools of one name: a call to it could be either."""
        names = [tool.function.name for tool in self.tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise APIError(400, f"tools: the names {twice} are given to more than one tool", "tools")


class Prediction(Strict):
    """OpenAI's predicted output: a hint for speed that never changes the answer; ignored."""
    type: Literal["content"]
    content: str | list[TextPart]


class ChatCompletionRequest(ChatTemplateFields, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    metadata: dict[str, str] | None = None          # accepted and ignored (see ``protocol``'s note)
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None         # false: one tool call at most (``tool_use``)
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[Literal["text"]] | None = None   # text is what comes back; "audio" is refused
    prediction: Prediction | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None   # vLLM's values
    echo: bool = False                              # vLLM's: the reply begins with the last message

    def echoed(self) -> str:
        """With ``echo``, what the reply begins with, as vLLM makes it: the last message's
        text where that message has the reply's role (the assistant's; with
        ``add_generation_prompt`` false, the last message's own, which the reply goes on
        from), else nothing."""
        if not self.echo:
            return ""
        last = self.checked_messages()[-1]
        role = "assistant" if self.add_generation_prompt else last["role"]
        return (last.get("content") or "") if last["role"] == role else ""

    def template_variables(self) -> dict:
        """Also ``reasoning_effort``, a template variable as vLLM makes it: a template that
        reads it (gpt-oss's) thinks as asked; the others ignore it, as a model without such a
        setting would."""
        variables = super().template_variables()
        if self.reasoning_effort is not None:
            if "reasoning_effort" in variables:
                raise APIError(400, "chat_template_kwargs: ['reasoning_effort'] is set by the request's own "
                               "field reasoning_effort, not here", "chat_template_kwargs")
            variables["reasoning_effort"] = self.reasoning_effort
        return variables

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs={self.top_logprobs}: must be an integer in [0, {MAX_LOGPROBS}]",
                           "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    def check_input(self) -> None:
        """Exactly one of ``prompt`` and ``messages``; the template's fields only with messages."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        for name in ("tools", "chat_template_kwargs"):
            if self.prompt is not None and getattr(self, name) is not None:
                raise APIError(400, f"{name} go through the chat template: send messages, not a prompt", name)
