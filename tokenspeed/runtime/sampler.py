"""One sampling route for every row: temperature, top-k, top-p, then Gumbel-max.

Greedy is ``top_k = 1``: only the largest logits survive the top-k mask and those rows
get no noise, so the result is exactly ``argmax`` (first index on ties). Inside the
captured decode step on CUDA, the unfiltered route is one Triton kernel pair whose noise
is keyed by each row's seed plus a device step counter (``sample_in_step``).
"""

import attrs
import torch

MIN_TEMPERATURE = 1e-5


@attrs.frozen
class SamplingTensors:
    """Per-row settings, one tensor each: ``[rows]``; ``seed`` keys the row's noise in
    ``sample_in_step``."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor

    @classmethod
    def build(cls, params, device, seeds: torch.Tensor | None = None) -> "SamplingTensors":
        """``seeds`` matter only to ``sample_in_step``; other routes draw from a generator."""
        seeds = torch.zeros(len(params), dtype=torch.int64) if seeds is None else seeds
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   seeds.to(device, torch.int64))


def needs_filter(params) -> bool:
    """Whether any row's top-k/top-p mask can drop a token other than by greedy's argmax."""
    return any(p.top_k > 1 or p.top_p < 1 for p in params)


def sample(logits: torch.Tensor, s: SamplingTensors, generator: torch.Generator | None = None,
           filtered: bool = True) -> torch.Tensor:
    """``filtered=False`` skips the top-k/top-p mask, which is the identity when no row has
    ``top_k > 1`` or ``top_p < 1`` (greedy rows only keep their maximum either way); it
    saves a sort over the vocabulary on every step of such batches."""
    greedy = (s.top_k == 1)[:, None]
    scores = logits.float()
    scores = torch.where(greedy, scores, scores / s.temperature.clamp_min(MIN_TEMPERATURE)[:, None])
    if filtered:
        scores = _top_k_top_p(scores, s.top_k, s.top_p)
    uniform = torch.rand(scores.shape, generator=generator, device=scores.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_(1e-10, 1.0 - 1e-7)))
    return torch.argmax(scores + torch.where(greedy, 0.0, gumbel), dim=-1)


def sample_in_step(logits: torch.Tensor, s: SamplingTensors, step: torch.Tensor,
                   out: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The captured step's sampler, unfiltered, writing into ``out``: on CUDA two Triton
    launches instead of ten passes over the vocabulary, noise keyed by ``s.seed + step``
    (``step`` advances on the device, so each replay draws anew); elsewhere ``sample``."""
    if logits.is_cuda:
        from tokenspeed.backends.kernels import triton_sampling
        return triton_sampling.gumbel_argmax(logits, s.temperature, s.top_k, s.seed, step, out=out)
    return out.copy_(sample(logits, s, generator, filtered=False))


def _top_k_top_p(scores, top_k, top_p):
    """Mask by rank, not by value, so ties at the boundary cannot widen the set; the
    stable sort ranks tied tokens by index, as argmax does."""
    vocab = scores.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp_max(vocab), vocab)
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    drop = torch.arange(vocab, device=scores.device)[None, :] >= k[:, None]
    probs = ordered.masked_fill(drop, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs            # mass strictly above each ranked token
    drop |= (before >= top_p[:, None]) & (top_p[:, None] < 1)  # the smallest nucleus
    return scores.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
