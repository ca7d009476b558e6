"""How a request samples: the settings users pass to ``generate`` (``ts.SamplingParams``)."""

import attrs


def _check(name, ok, value, limit):
    if not ok:
        raise ValueError(f"{name}={value!r}: must be {limit}")


@attrs.frozen
class SamplingParams:
    """``temperature=0`` (greedy) is normalised to ``top_k=1``: one sampling route for all."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    ignore_eos: bool = False

    def __attrs_post_init__(self):
        _check("temperature", self.temperature >= 0, self.temperature, ">= 0")
        _check("top_p", 0 < self.top_p <= 1, self.top_p, "in (0, 1]")
        _check("top_k", self.top_k >= 0, self.top_k, ">= 0 (0 disables top-k)")
        _check("max_tokens", self.max_tokens >= 1, self.max_tokens, ">= 1")
        if self.temperature == 0:
            object.__setattr__(self, "top_k", 1)

    @property
    def greedy(self) -> bool:
        return self.top_k == 1
