"""The progress bar of an ``LLM.generate`` call."""

import time
from collections.abc import Callable

from tqdm import tqdm

from tokenspeed.scheduling.request import Request


class Progress:
    """A bar over a ``generate`` call's prompts, with input and output tokens per second."""

    def __init__(self, groups: list[list[Request]], enabled: bool | Callable[..., tqdm]):
        """``enabled``: whether to show the bar, or (vLLM's ``use_tqdm``) a callable that
        makes it, such as ``functools.partial(tqdm, leave=False)``: called with the keywords
        vLLM calls it with (``total``, ``desc``, ``dynamic_ncols``, ``postfix``), so a
        factory written for vLLM's bar makes ours."""
        self.left = {id(r): g for g in groups for r in g}
        if callable(enabled):
            self.bar = enabled(total=len(groups), desc="generating", dynamic_ncols=True, postfix="")
        else:
            self.bar = tqdm(total=len(groups), desc="generating", unit="prompt", disable=not enabled,
                            dynamic_ncols=True)
        self.start, self.prompt_tokens, self.output_tokens = time.perf_counter(), 0, 0

    def update(self, request: Request) -> None:
        group = self.left.pop(id(request))
        if all(r.finished for r in group) and not any(id(r) in self.left for r in group):
            self.prompt_tokens += len(group[0].prompt)
            self.output_tokens += sum(len(r.output) for r in group)
            elapsed = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(f"input {self.prompt_tokens / elapsed:.0f} tok/s, "
                                     f"output {self.output_tokens / elapsed:.0f} tok/s")
            self.bar.update(1)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
