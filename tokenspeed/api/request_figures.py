"""The figures a finished request reports: its times and counts, read from the engine's
``Request`` here alone, so that the request's record of them may change in one place."""

from tokenspeed.api.messages import Completed
from tokenspeed.execution.outputs import RequestMetrics
from tokenspeed.scheduling.request import Request


def completed(request: Request) -> Completed:
    """A finished completion's figures for the server's metrics, over every token the
    engine made (a client that cut the completion at a stop string counts the tokens it
    kept: ``PromptOutput.completed``)."""
    ttft = tpot = None
    num_tokens = len(request.output)
    if request.first_token_time is not None:
        ttft = request.first_token_time - request.arrival_time
        if num_tokens > 1 and request.finish_time is not None:
            tpot = (request.finish_time - request.first_token_time) / (num_tokens - 1)
    return Completed(num_tokens, request.finish_reason or "abort", ttft, tpot)


def prompt_metrics(group: list[Request], num_prompt_tokens: int, num_output_tokens: int) -> RequestMetrics:
    """One prompt's metrics over its samples; ``num_output_tokens``: those they kept."""
    first = [r.first_token_time for r in group if r.first_token_time is not None]
    windows = sum(r.num_verify_steps for r in group)
    return RequestMetrics(group[0].arrival_time, min(first, default=None), max(r.finish_time for r in group),
                          num_prompt_tokens, num_output_tokens, group[0].num_cached_prompt_tokens,
                          sum(r.num_verified_tokens for r in group) / windows if windows else None)
