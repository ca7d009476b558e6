"""Greedy tokens compared across row counts are safe only where the top-2 logit margin
exceeds what accumulation order can change (a CPU BLAS blocks 3 rows and 4 rows
differently). ``greedy_margins`` records the margin of every greedy row the runners
sample, so a test can check it before it trusts a token comparison.

Not a test module: shared by the graph, overlap and error tests.
"""

import torch

from tokenspeed.models.random import TINY_LLAMA, random_model

# Bounds the logit difference between two row counts of the same float32 step on these
# tiny models (seen: 1.5e-7); margins must be a hundred times larger.
ROW_COUNT_TOLERANCE = 1e-5
MIN_MARGIN = 1e-3


def decisive_model(seed: int = 3, config=TINY_LLAMA):
    """A tiny random Llama whose greedy choices are clear: matrices ~ N(0, 1/fan_in),
    embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.2^2)."""
    model = random_model(config, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)
    return model


def greedy_margins(monkeypatch) -> list[float]:
    """Record the top-1/top-2 logit gap of every row sampled from here on: use it on an
    engine without graphs, which samples live rows only (no padding)."""
    from tokenspeed.execution import decode_runner, prefill_runner
    margins: list[float] = []

    def recorded(sampler):
        def run(logits, *args, **kwargs):
            top2 = logits.float().topk(2, dim=-1).values
            margins.extend((top2[:, 0] - top2[:, 1]).tolist())
            return sampler(logits, *args, **kwargs)
        return run

    monkeypatch.setattr(decode_runner, "gumbel_argmax", recorded(decode_runner.gumbel_argmax))
    monkeypatch.setattr(prefill_runner, "sample", recorded(prefill_runner.sample))
    return margins


def assert_decisive(margins: list[float]) -> None:
    assert margins, "no logits were sampled"
    assert min(margins) > MIN_MARGIN, f"a greedy margin of {min(margins):.2e} is too close to call"
