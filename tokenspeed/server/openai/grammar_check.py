"""Structured outputs checked at the door: a request's constraint is compiled against the
model's vocabulary before it is queued, so a bad schema, regular expression, grammar or
tool is a 400 naming the field it came from, never a fault in the engine.

The vocabulary as llguidance sees it (``guidance_tokenizer``) walks every token, so it is
built once per server, by the first request that needs it.
"""

import threading

import attrs

from tokenspeed.errors import RefusedRequest
from tokenspeed.server.openai.api_error import APIError
from tokenspeed.structured import StructuredOutputs, compile_grammar, guidance_tokenizer

OWN_FIELD = "structured_outputs"   # its refusals name their own field already


@attrs.frozen
class Constraint:
    """A request's constraint and the request field it came from (``structured_outputs``,
    ``response_format``, ``tool_choice``), which a refusal names."""

    spec: StructuredOutputs
    field: str


def refused(field: str, exc: RefusedRequest) -> APIError:
    """A refusal of a constraint as a 400 naming ``field`` with the refusal's own reason."""
    if field == OWN_FIELD:
        return APIError(400, str(exc), exc.field)
    reason = str(exc).split(": ", 1)[-1]
    return APIError(400, f"{field}: {reason}", field)


class GrammarCheck:
    """Compiles constraints against one tokenizer's vocabulary (None: a server without a
    tokenizer, which refuses every constraint). Thread-safe: handlers call it off the
    event loop."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._guidance = None
        self._lock = threading.Lock()

    def check(self, constraint: Constraint | None, vocab_size: int) -> None:
        if constraint is None:
            return
        if self._tokenizer is None:
            raise APIError(400, f"{constraint.field}: structured outputs are compiled against the model's "
                           "tokenizer, and this server has none", constraint.field)
        try:
            compile_grammar(constraint.spec, self._vocabulary(vocab_size))
        except RefusedRequest as exc:
            raise refused(constraint.field, exc) from exc

    def _vocabulary(self, vocab_size: int):
        with self._lock:
            if self._guidance is None:
                self._guidance = guidance_tokenizer(self._tokenizer, vocab_size)
            return self._guidance
