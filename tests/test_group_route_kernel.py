"""``tokenspeed::group_top_k``: the Triton kernel (under the interpreter on the CPU) against
the reference (which ``test_deepseek_router`` holds against transformers' routers); the
grouped choice after the gate (and its norm) in ``route``'s one launch; the router pass
and DeepSeek's decode IR."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

import tokenspeed as ts  # noqa: E402
from tokenspeed import stages  # noqa: E402
from tokenspeed.backends.kernels import group_route_reference, reference, triton_group_route, triton_route  # noqa: E402
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
    experts with the same weights; V2's (whose weights are its choice) the largest first."""
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


def one_hot_gate(rows: int, experts: int, hidden: int, dtype, seed: int):
    """Rows of one feature each, so a row's logits are one column of the gate, exact in any
    order of summing; the gate's values bfloat16's, distinct (as their group sums are)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.one_hot(torch.randint(0, hidden, (rows,), generator=gen), hidden).to(DEVICE, dtype)
    gate = torch.randn(experts, hidden, generator=gen).to(torch.bfloat16).to(DEVICE, torch.float32)
    return x, gate, (0.3 * torch.randn(experts, generator=gen)).to(DEVICE)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(layout=st.sampled_from([(64, 8), (160, 8), (64, 1), (12, 3)]), rows=st.integers(0, 4),
       method=st.sampled_from(group_route_reference.METHODS), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       normed=st.booleans(), seed=st.integers(0, 99))
def test_the_gate_and_grouped_choice_in_one_launch_choose_as_the_ops_they_replace(layout, rows, method, dtype,
                                                                                  normed, seed):
    """``route`` and ``norm_route`` with a grouping (DeepSeek's float32 gate) against the
    reference's gate product and ``group_top_k``: the same experts, the same weights."""
    (experts, n_group), k, counters = layout, 4, torch.zeros(4, dtype=torch.int32, device=DEVICE)
    x, gate, bias = one_hot_gate(max(rows, 1) if normed else rows, experts, 200, dtype, seed)
    grouping = triton_group_route.Grouping(bias, n_group, min(2, n_group), method)
    args = (gate, k, method == "noaux_tc", 2.5, torch.float32, counters)
    kwargs = dict(correction_bias=bias.cpu(), n_group=n_group, topk_group=grouping.topk_group, method=method)
    if normed:   # one row: the launch that normalises its input too
        x, norm_weight = x[:1], torch.ones(200, dtype=dtype, device=DEVICE)
        got = triton_route.norm_route(x, None, norm_weight, 1e-6, *args, grouping)
        want = reference.norm_route(x.cpu(), None, norm_weight.cpu(), 1e-6, gate.cpu(), *args[1:4], torch.float32,
                                    **kwargs)
    else:
        got = triton_route.route(x, *args, grouping)
        want = reference.route(x.cpu(), gate.cpu(), *args[1:4], torch.float32, **kwargs)
    assert not counters.any()
    got_choice, want_choice = chosen(got[0].cpu(), got[1].cpu()), chosen(want[0], want[1])
    assert [set(g) for g in got_choice] == [set(w) for w in want_choice]
    for g, w in zip(got_choice, want_choice):
        assert g == pytest.approx(w, rel=1e-4)


def test_the_router_pass_takes_a_grouped_choice_after_the_float32_gate():
    """``fuse_router``: DeepSeek's cast gate and ``group_top_k`` become one ``route`` whose
    keywords carry the grouping (the bias only where the choice has one)."""
    from torch import fx
    from tokenspeed.ir.ops import GROUP_TOP_K, ROUTE
    from tokenspeed.ir.program import Program
    from tokenspeed.passes.router import fuse_router
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_parameter("gate", torch.nn.Parameter(torch.zeros(8, 4)))
    gm.register_buffer("bias", torch.zeros(8))
    graph = gm.graph
    x, gate, bias = graph.placeholder("x"), graph.get_attr("gate"), graph.get_attr("bias")
    choices = []
    for method, b in (("noaux_tc", bias), ("group_limited_greedy", None)):
        logits = graph.call_function(torch.nn.functional.linear, (graph.call_method("float", (x,)),
                                                                  graph.call_method("float", (gate,))))
        choices.append(graph.call_function(GROUP_TOP_K, (logits, b, 2, 4, 2, method, True, 2.5)))
    graph.output(choices)
    gm.recompile()
    nodes = list(fuse_router(Program(mode="decode", graph_module=gm)).graph_module.graph.nodes)
    routes = [(n.args, n.kwargs) for n in nodes if n.target == ROUTE]
    assert [args[2:] for args, _ in routes] == [(2, True, 2.5)] * 2
    assert [{k: v for k, v in kwargs.items() if k != "correction_bias"} for _, kwargs in routes] == \
        [dict(logits_dtype=torch.float32, n_group=4, topk_group=2, method=m) for m in group_route_reference.METHODS[::-1]]
    assert [getattr(kwargs.get("correction_bias"), "name", None) for _, kwargs in routes] == ["bias", None]
    assert not any(n.target in (GROUP_TOP_K, torch.nn.functional.linear) for n in nodes)


@pytest.mark.parametrize("variant", ["v2_moe", "v3_moe"])
def test_deepseek_routes_a_decode_step_in_one_op_and_a_prompt_with_the_gate_and_the_choice(variant):
    """Decode: the norm, the float32 gate and the grouped choice in one ``norm_route``;
    prefill keeps the gate's product and ``group_top_k``."""
    from deepseek_models import checkpoint
    traced = stages.trace(ts.models.load(checkpoint(variant)))
    decode, prefill = traced.lower("decode").as_text(), traced.lower("prefill").as_text()
    method = "noaux_tc" if variant == "v3_moe" else "group_limited_greedy"
    assert f"n_group=4, topk_group=2, method='{method}'" in decode and "tokenspeed.norm_route(" in decode
    assert "group_top_k(" not in decode and "masked_fill" not in decode
    assert "tokenspeed.group_top_k(" in prefill and "route(" not in prefill
    assert ("correction_bias=" in decode) == (variant == "v3_moe")


@pytest.mark.gpu
@pytest.mark.parametrize("normed", [False, True])
def test_the_grouped_gate_in_a_cuda_graph_chooses_as_an_eager_launch(normed):
    """DeepSeek-V3's layout (8 of 256 experts in 4 of 8 groups, hidden 7,168; one row for the
    norm's launch): a replay with new features chooses what an eager launch chooses, to the
    bit."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = 1 if normed else 16
    x = torch.randn(rows, 7168, device="cuda", generator=gen).to(torch.bfloat16)
    gate = torch.randn(256, 7168, device="cuda", generator=gen) * 0.02
    bias = 0.1 * torch.randn(256, device="cuda", generator=gen)
    norm_weight = torch.ones(7168, dtype=torch.bfloat16, device="cuda")
    counters, grouping = torch.zeros(8, dtype=torch.int32, device="cuda"), triton_group_route.Grouping(bias, 8, 4,
                                                                                                        "noaux_tc")
    args = (gate, 8, True, 2.5, torch.float32, counters, grouping)
    run = (lambda: triton_route.norm_route(x, None, norm_weight, 1e-6, *args)) if normed else \
        (lambda: triton_route.route(x, *args))
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run()
    x.copy_(torch.randn(rows, 7168, device="cuda", generator=gen))
    graph.replay()
    eager = run()
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager)) and not counters.any()

