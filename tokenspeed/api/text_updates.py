"""What a prompt's answer gained, as its caller reads it: text and the tokens kept, each
completion's final finish (``PromptOutput`` makes them from the engine's token updates;
the server's responses and ``LLM`` read them)."""

import msgspec

from tokenspeed.execution.outputs import TokenLogprobs


class TextRecord(msgspec.Struct, frozen=True, gc=False):
    """Built per completion per step in a busy server process: a Struct builds in C, and
    untracked by the cycle collector (it holds values only) it costs less again."""


class CompletionDelta(TextRecord):
    """What one completion's answer gained; ``finish_reason`` once it is final
    (``stop_reason``: the stop string or stop token id that ended it, if one did)."""
    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: str | int | None


class GroupUpdate(TextRecord):
    """A prompt's completions' gains; ``finished`` once every answer is final (or
    ``error``: a step failed and took the request with it); ``num_output_tokens``: the
    tokens its completions kept so far."""
    deltas: tuple[CompletionDelta, ...]
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None
    refused: bool = False   # the error is the request's own (``TokenUpdate.refused``)
