"""What a finished request returns to its caller (``ts.RequestOutput``)."""

import attrs


@attrs.frozen
class RequestOutput:
    request_id: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop" | "length"
    text: str | None = None
