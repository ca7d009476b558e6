"""``tokenspeed::softmax_top_k``: the Triton kernel (under the interpreter on the CPU)
against the reference, and the reference against the routing it replaced."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

from tokenspeed.backends.kernels import reference, triton_route  # noqa: E402
from tokenspeed.errors import InternalError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def chosen(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    """Each row's experts and weights, whatever order the picks came in."""
    return [dict(zip(row_ids.tolist(), row_weights.tolist())) for row_ids, row_weights in zip(ids, weights)]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(rows=st.integers(0, 6), experts=st.sampled_from([4, 60, 64, 128]), k=st.integers(1, 8),
       normalize=st.booleans(), scale=st.sampled_from([1.0, 2.5]), dtype=st.sampled_from([torch.float32,
                                                                                            torch.bfloat16]),
       seed=st.integers(0, 99))
def test_the_kernel_picks_the_references_experts_with_its_weights(rows, experts, k, normalize, scale, dtype, seed):
    """Distinct logits (a tie may go either way), 0.1 apart: distinct in bfloat16 too."""
    k, gen = min(k, experts), torch.Generator().manual_seed(seed)
    logits = torch.stack([torch.randperm(experts, generator=gen) * 0.1 - 6.0 for _ in range(rows)]) if rows \
        else torch.zeros(0, experts)
    logits = logits.to(DEVICE, dtype)
    weights, ids = triton_route.softmax_top_k(logits, k, normalize, scale)
    want_weights, want_ids = reference.softmax_top_k(logits.float(), k, normalize, scale)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (rows, k)
    got, want = chosen(weights.cpu(), ids.cpu()), chosen(want_weights.cpu(), want_ids.cpu())
    assert [set(g) for g in got] == [set(w) for w in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-7)


def test_the_largest_comes_first_and_the_lowest_expert_wins_a_tie():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, -2.0]], device=DEVICE)
    weights, ids = triton_route.softmax_top_k(logits, 3, False, 1.0)
    assert ids.tolist() == [[1, 3, 2]]
    assert weights[0, 0] == weights[0, 1] > weights[0, 2]


def test_a_row_of_nan_still_names_experts_that_exist():
    """A broken row must not send the expert kernels outside the weights of other rows."""
    logits = torch.full((2, 8), float("nan"), device=DEVICE)
    _, ids = triton_route.softmax_top_k(logits, 2, True, 1.0)
    assert bool(((ids >= 0) & (ids < 8)).all())


def test_the_reference_is_transformers_routing():
    """Softmax in float32 of the gate's logits, top k, renormalised (Qwen3-MoE, Mixtral)."""
    logits = torch.randn(5, 16, dtype=torch.bfloat16)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    want_weights, want_ids = torch.topk(probs, 4, dim=-1)
    weights, ids = reference.softmax_top_k(logits, 4, True, 1.0)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights, want_weights / want_weights.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("k, experts", [(0, 8), (9, 8)])
def test_a_k_outside_the_experts_is_refused(k, experts):
    with pytest.raises(InternalError, match=f"k={k}"):
        triton_route.softmax_top_k(torch.zeros(1, experts, device=DEVICE), k, False, 1.0)
