"""What one engine can serve, as a record a server in another process can check against.

The engine checks every prompt with ``check_prompt`` before queueing it; the OpenAI server
runs the engine in its own process and checks with the same function and the same record,
so a refusal reads the same wherever it is made.
"""

import attrs

from tokenspeed.runtime.sampling_params import SamplingParams


@attrs.frozen
class PromptLimits:
    vocab_size: int
    max_model_len: int
    page_size: int
    usable_pages: int            # the pool's pages, less the null page


def check_prompt(limits: PromptLimits, index: int, prompt: tuple[int, ...], params: SamplingParams) -> None:
    """Refuse, naming prompt ``index`` and the limit, what the engine cannot serve."""
    where = f"prompt {index}"
    if not prompt:
        raise ValueError(f"{where} is empty")
    ids = (*prompt, *params.stop_token_ids)
    if min(ids) < 0 or max(ids) >= limits.vocab_size:   # at C speed; the loop only to name one
        bad = next(t for t in ids if not 0 <= t < limits.vocab_size)
        raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
    total = len(prompt) + params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(f"{where}: {len(prompt)} prompt tokens + max_tokens={params.max_tokens} "
                         f"= {total} exceeds max_model_len={limits.max_model_len}")
    pages = -(-total // limits.page_size)
    if pages > limits.usable_pages:
        raise ValueError(f"{where}: needs {pages} KV pages, the pool has {limits.usable_pages}")
