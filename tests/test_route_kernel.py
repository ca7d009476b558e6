"""``tokenspeed::softmax_top_k``: the Triton kernel (under the interpreter on the CPU)
against the reference, and the reference against the routing it replaced."""

import os
from unittest import mock

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


@settings(max_examples=25, deadline=None, derandomize=True)
@given(experts=st.integers(1, 130), k=st.integers(1, 8), levels=st.integers(1, 4), seed=st.integers(0, 99))
def test_ties_go_to_the_lowest_expert_in_every_pick(experts, k, levels, seed):
    """Logits from a few levels (many ties; one level: all equal): the picks are a stable
    descending sort's, the lowest expert first among equals."""
    k, gen = min(k, experts), torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, levels, (3, experts), generator=gen) * 0.5).to(DEVICE)
    weights, ids = triton_route.softmax_top_k(logits, k, False, 1.0)
    probs = torch.softmax(logits.float().cpu(), -1)
    want = torch.sort(probs, dim=-1, descending=True, stable=True)
    assert ids.cpu().tolist() == want.indices[:, :k].tolist()
    torch.testing.assert_close(weights.cpu(), want.values[:, :k], rtol=1e-5, atol=1e-7)


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


def top_weights(weights: torch.Tensor) -> list[list[float]]:
    return [sorted(row, reverse=True) for row in weights.cpu().tolist()]


@settings(max_examples=20, deadline=None, derandomize=True)
@given(rows=st.integers(0, triton_route.ROUTE_MAX_ROWS), experts=st.sampled_from([8, 60, 64, 128]),
       hidden=st.sampled_from([64, 200, 512]), k=st.integers(1, 8), normalize=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), float_logits=st.booleans(), seed=st.integers(0, 99))
def test_the_gate_and_choice_in_one_launch_choose_as_the_ops_they_replace(rows, experts, hidden, k, normalize, dtype,
                                                                           float_logits, seed):
    """Features and gate of -1, 0 and 1 give integer logits that every order of summing
    gets exactly (and bfloat16 holds), so the kernel's logits are the reference's: the
    chosen weights agree, and the experts too where no tie sits at the k-th pick. The
    counter is left zeroed for the next launch."""
    k, gen = min(k, experts), torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (rows, hidden), generator=gen).to(DEVICE, dtype)
    gate = torch.randint(-1, 2, (experts, hidden), generator=gen).to(DEVICE, torch.float32 if float_logits else dtype)
    logits_dtype = torch.float32 if float_logits else None
    counters = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    weights, ids = triton_route.route(x, gate, k, normalize, 2.5, logits_dtype, counters)
    want_weights, want_ids = reference.route(x.cpu(), gate.cpu(), k, normalize, 2.5, logits_dtype)
    assert weights.shape == ids.shape == (rows, k) and not counters.any()
    assert all(g == pytest.approx(w, rel=1e-5) for g, w in zip(top_weights(weights), top_weights(want_weights)))
    logits = torch.sort((x.float() @ gate.float().T).cpu(), dim=-1, descending=True).values
    for row in range(rows):
        if k == experts or logits[row, k - 1] > logits[row, k]:
            assert set(ids[row].tolist()) == set(want_ids[row].tolist())


def test_a_gate_in_bfloat16_rounds_its_logits_before_the_choice():
    """Logits 256 and 257 are one in bfloat16: the choice ties, and the lower expert wins,
    as the unfused gate's bfloat16 output would have it; float32 logits tell them apart."""
    x = torch.ones(1, 257, dtype=torch.bfloat16, device=DEVICE)
    gate = torch.zeros(3, 257, dtype=torch.bfloat16, device=DEVICE)
    gate[0, :256], gate[1] = 1.0, 1.0
    counters = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    weights, ids = triton_route.route(x, gate, 1, False, 1.0, None, counters)
    assert ids.tolist() == [[0]] and weights.tolist() == [[0.5]]
    _, ids = triton_route.route(x, gate.float(), 1, False, 1.0, torch.float32, counters)
    assert ids.tolist() == [[1]]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(rows=st.integers(1, 3), hidden=st.sampled_from([64, 200, 520]), residual=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), float_logits=st.booleans(),
       norm_tile=st.sampled_from([triton_route.NORM_TILE, 128]), seed=st.integers(0, 99))
def test_the_router_with_its_norm_chooses_as_the_norm_and_the_route_apart(rows, hidden, residual, dtype, float_logits,
                                                                         norm_tile, seed):
    """``norm_route`` against ``reference.norm_route`` (the norm's op, then the route's): the
    sum to the bit; the normed rows to float32's rounding, or two bfloat16 steps (the
    interpreter truncates where the GPU rounds to nearest, at each of the two roundings);
    the choice where the reference's logits leave a margin at the k-th pick, and its weights
    (a tenth apart for a bfloat16 gate, whose logits are rounded before the softmax). Every
    program reads the whole row for its statistics (in one tile, or several of a smaller
    ``NORM_TILE``), and the rows span several programs (``GATE_BLOCK_K`` features each)."""
    gen, k, experts = torch.Generator().manual_seed(seed), 4, 60
    x, res = (torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype) for _ in range(2))
    norm_weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    gate = (torch.randn(experts, hidden, generator=gen) * 0.1).to(DEVICE, torch.float32 if float_logits else dtype)
    logits_dtype, counters = torch.float32 if float_logits else None, torch.zeros(4, dtype=torch.int32, device=DEVICE)
    res = res if residual else None
    with mock.patch.object(triton_route, "NORM_TILE", norm_tile):
        got = triton_route.norm_route(x, res, norm_weight, 1e-6, gate, k, True, 1.0, logits_dtype, counters)
    want = reference.norm_route(x.cpu(), None if res is None else res.cpu(), norm_weight.cpu(), 1e-6, gate.cpu(), k,
                                True, 1.0, logits_dtype)
    assert len(got) == len(want) == 3 + residual and not counters.any()
    if residual:
        assert torch.equal(got[3].cpu(), want[3]) if dtype == torch.float32 else \
            torch.allclose(got[3].cpu().float(), want[3].float(), rtol=2 ** -7, atol=0)
    torch.testing.assert_close(got[2].cpu().float(), want[2].float(), rtol=1e-5 if dtype == torch.float32 else 2 ** -6,
                               atol=1e-6 if dtype == torch.float32 else 1e-2)
    logits = torch.sort(want[2].float() @ gate.cpu().float().T, dim=-1, descending=True).values
    for row in range(rows):
        if logits[row, k - 1] - logits[row, k] > 0.05:
            assert set(got[1][row].tolist()) == set(want[1][row].tolist())
            assert sorted(got[0][row].tolist()) == pytest.approx(sorted(want[0][row].tolist()), abs=1e-6,
                                                                 rel=1e-4 if dtype == torch.float32 else 0.1)


@pytest.mark.parametrize("rows, norm_tile", [(1, triton_route.NORM_TILE), (2, triton_route.NORM_TILE), (1, 256)],
                         ids=["one launch", "the norm's kernel first", "a row wider than a tile"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "alone"])
def test_the_backends_normed_gate_returns_what_the_reference_does(rows, norm_tile, residual, monkeypatch):
    """``cuda.norm_route``: one row in one launch; more, or a row wider than ``NORM_TILE``,
    after the norm's own kernel; either way the choice, the normed rows and the sum (with a
    residual), in the op's order."""
    from tokenspeed.backends.kernels import cuda
    monkeypatch.setattr(triton_route, "NORM_TILE", norm_tile)
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 300, generator=gen).to(DEVICE) for _ in range(2))
    norm_weight, gate = torch.rand(300, generator=gen).to(DEVICE) + 0.5, torch.randn(16, 300, generator=gen).to(DEVICE)
    res, counters = res if residual else None, torch.zeros(4, dtype=torch.int32, device=DEVICE)
    got = cuda.norm_route(x, res, norm_weight, 1e-6, gate, 3, True, 1.0, None, counters)
    want = reference.norm_route(x.cpu(), None if res is None else res.cpu(), norm_weight.cpu(), 1e-6, gate.cpu(), 3,
                                True, 1.0)
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want] == \
        [(rows, 3), (rows, 3), (rows, 300)] + [(rows, 300)] * residual
    assert torch.equal(got[1].sort(dim=-1).values.cpu(), want[1].sort(dim=-1).values) and not counters.any()
    for g, w in zip(got[2:], want[2:]):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-6)


def test_the_normed_gate_refuses_a_residual_or_norm_weight_that_does_not_fit():
    x, gate, counters = (torch.zeros(1, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE),
                         torch.zeros(1, dtype=torch.int32, device=DEVICE))
    for residual, norm_weight in ((torch.zeros(1, 6, device=DEVICE), torch.ones(8, device=DEVICE)),
                                  (None, torch.ones(6, device=DEVICE))):
        with pytest.raises(InternalError, match=r"norm_route wants a residual shaped as x \(1, 8\)"):
            triton_route.norm_route(x, residual, norm_weight, 1e-6, gate, 2, False, 1.0, None, counters)


def test_the_one_launch_gate_refuses_more_rows_than_a_decode_step():
    rows = triton_route.ROUTE_MAX_ROWS + 1
    with pytest.raises(InternalError, match=f"T <= {triton_route.ROUTE_MAX_ROWS}"):
        triton_route.route(torch.zeros(rows, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE), 2, False, 1.0,
                           None, torch.zeros(1, dtype=torch.int32, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("experts, k, gate_dtype", [(64, 6, torch.float32), (128, 8, torch.bfloat16)],
                         ids=["deepseek-v2-lite", "qwen3-30b-a3b"])
@pytest.mark.parametrize("rows", [1, 16])
def test_the_gate_in_a_cuda_graph_chooses_as_an_eager_launch(experts, k, gate_dtype, rows):
    """At the models' shapes (hidden 2048): a replay with new features chooses what an
    eager launch chooses, to the bit, and the launches share the counters."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    gate = (torch.randn(experts, 2048, device="cuda", generator=gen) * 0.02).to(gate_dtype)
    logits_dtype = torch.float32 if gate_dtype == torch.float32 else None
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")
    triton_route.route(x, gate, k, True, 1.0, logits_dtype, counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = triton_route.route(x, gate, k, True, 1.0, logits_dtype, counters)
    x.copy_(torch.randn(rows, 2048, device="cuda", generator=gen))
    graph.replay()
    want_weights, want_ids = triton_route.route(x, gate, k, True, 1.0, logits_dtype, counters)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights) and not counters.any()
    ref_weights, ref_ids = reference.route(x, gate, k, True, 1.0, logits_dtype)
    assert (ids.sort(dim=-1).values == ref_ids.sort(dim=-1).values).float().mean() > 0.95
    torch.testing.assert_close(weights.sort(dim=-1).values, ref_weights.sort(dim=-1).values, rtol=2e-2, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("experts, k, gate_dtype", [(64, 6, torch.float32), (128, 8, torch.bfloat16)],
                         ids=["deepseek-v2-lite", "qwen3-30b-a3b"])
def test_the_normed_gate_in_a_cuda_graph_chooses_as_an_eager_launch(experts, k, gate_dtype):
    """``norm_route`` at the models' shapes (hidden 2048, one row): a replay with new
    features and residual gives an eager launch's outputs to the bit, and the reference's
    sum to the bit and its normed row within a bfloat16 step."""
    gen = torch.Generator(device="cuda").manual_seed(k)
    x, res = (torch.randn(1, 2048, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_weight = (torch.rand(2048, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    gate = (torch.randn(experts, 2048, device="cuda", generator=gen) * 0.02).to(gate_dtype)
    logits_dtype = torch.float32 if gate_dtype == torch.float32 else None
    counters = torch.zeros(8, dtype=torch.int32, device="cuda")
    run = lambda: triton_route.norm_route(x, res, norm_weight, 1e-6, gate, k, True, 1.0, logits_dtype,  # noqa: E731
                                          counters)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run()
    x.copy_(torch.randn(1, 2048, device="cuda", generator=gen))
    res.copy_(torch.randn(1, 2048, device="cuda", generator=gen))
    graph.replay()
    eager = run()
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager)) and not counters.any()
    want = reference.norm_route(x, res, norm_weight, 1e-6, gate, k, True, 1.0, logits_dtype)
    assert torch.equal(eager[3], want[3])
    torch.testing.assert_close(eager[2].float(), want[2].float(), rtol=2 ** -7, atol=1e-2)
    assert (eager[1].sort(dim=-1).values == want[1].sort(dim=-1).values).float().mean() > 0.8
