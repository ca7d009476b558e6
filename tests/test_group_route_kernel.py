"""``tokenspeed::group_top_k``: the Triton kernel (under the interpreter on the CPU) against
the reference (which ``test_deepseek_router`` holds against transformers' routers)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

from tokenspeed.backends.kernels import group_route_reference, triton_group_route  # noqa: E402
from tokenspeed.errors import InternalError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (experts, groups): DeepSeek-V3's 256 in 8, V2's 160 in 8 (20 a group), Moonlight's 64 in 1, and odd ones
LAYOUTS = [(256, 8), (160, 8), (64, 1), (8, 4), (12, 3), (60, 6), (40, 10)]


def chosen(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    """Each row's experts and weights, whatever order the picks came in."""
    return [dict(zip(row_ids.tolist(), row_weights.tolist())) for row_ids, row_weights in zip(ids, weights)]


@settings(max_examples=30, deadline=None, derandomize=True)
@given(layout=st.sampled_from(LAYOUTS), rows=st.integers(0, 5), topk_group=st.integers(1, 10), k=st.integers(1, 8),
       method=st.sampled_from(group_route_reference.METHODS), normalize=st.booleans(),
       scale=st.sampled_from([1.0, 2.5]), seed=st.integers(0, 99))
def test_the_kernel_picks_the_references_experts_with_its_weights(layout, rows, topk_group, k, method, normalize,
                                                                  scale, seed):
    """Random logits and biases (ties of groups or experts have no set winner): the same
    experts with the same weights, the largest first."""
    experts, n_group = layout
    topk_group = min(topk_group, n_group)
    k = min(k, topk_group * experts // n_group)
    gen = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(rows, experts, generator=gen)).to(DEVICE)
    bias = (0.3 * torch.randn(experts, generator=gen)).to(DEVICE)
    weights, ids = triton_group_route.group_top_k(logits, bias, k, n_group, topk_group, method, normalize, scale)
    want_weights, want_ids = group_route_reference.group_top_k(logits, bias, k, n_group, topk_group, method,
                                                               normalize, scale)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (rows, k)
    got, want = chosen(weights.cpu(), ids.cpu()), chosen(want_weights.cpu(), want_ids.cpu())
    assert [set(g) for g in got] == [set(w) for w in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, rel=1e-5, abs=1e-7)
    if method == "group_limited_greedy":
        assert torch.equal(weights, weights.sort(dim=-1, descending=True).values)


def test_groups_left_out_give_no_expert_even_with_the_largest_bias():
    """noaux_tc: experts 0-3 and 4-7 are two groups; the second ranks higher by its two best,
    so expert 0, the single best choice, is not taken."""
    logits = torch.zeros(1, 8, device=DEVICE)
    bias = torch.tensor([5.0, 0, 0, 0, 3.0, 3.0, 0, 0], device=DEVICE)
    _, ids = triton_group_route.group_top_k(logits, bias, 2, 2, 1, "noaux_tc", True, 1.0)
    assert sorted(ids[0].tolist()) == [4, 5]


def test_a_row_of_nan_still_names_experts_that_exist():
    """A broken row must not send the expert kernels outside the weights of other rows."""
    logits = torch.full((2, 16), float("nan"), device=DEVICE)
    for method in group_route_reference.METHODS:
        _, ids = triton_group_route.group_top_k(logits, torch.zeros(16, device=DEVICE), 3, 4, 2, method, True, 1.0)
        assert bool(((ids >= 0) & (ids < 16)).all())


@pytest.mark.parametrize("args, match", [
    ((8, None, 2, 4, 2, "noaux_tc"), "bias"),
    ((8, "bias", 5, 4, 2, "noaux_tc"), "k=5 must be in"),
    ((8, None, 2, 3, 2, "group_limited_greedy"), "n_group=3"),
    ((8, None, 2, 4, 5, "group_limited_greedy"), "topk_group=5"),
    ((8, "bias", 2, 8, 2, "noaux_tc"), "at least 2 experts"),
    ((8, None, 2, 4, 2, "greedy"), "'greedy'"),
])
def test_choices_transformers_would_not_make_are_refused(args, match):
    experts, bias, k, n_group, topk_group, method = args
    logits = torch.zeros(1, experts, device=DEVICE)
    bias = torch.zeros(experts, device=DEVICE) if bias else None
    for op in (triton_group_route.group_top_k, group_route_reference.group_top_k):
        with pytest.raises(InternalError, match=match):
            op(logits, bias, k, n_group, topk_group, method, False, 1.0)
