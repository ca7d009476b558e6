"""What a request's caller reports about it (``RequestMetrics``), recorded as it runs."""

import time

import attrs


@attrs.define
class RequestStats:
    """Wall-clock times (``time.time()``); ``num_cached_prompt_tokens``: prompt tokens found
    cached when it was first admitted (not computed); ``num_verify_steps``: its speculative
    windows (those with drafts), ``num_verified_tokens``: the tokens they kept."""
    arrival_time: float = attrs.Factory(time.time)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_prompt_tokens: int = 0
    num_verify_steps: int = 0
    num_verified_tokens: int = 0

    def record_verify(self, kept: int, drafted: int) -> None:
        """Count a window of ``drafted`` drafts that kept ``kept`` tokens (a window without
        drafts, a plain row in a verify step, is not a speculative window)."""
        if drafted:
            self.num_verify_steps += 1
            self.num_verified_tokens += kept
