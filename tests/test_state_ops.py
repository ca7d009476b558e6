"""The recurrent layers' ops (``causal_conv_silu``, ``gated_delta_rule``): their references
against transformers' Qwen3-Next functions on the CPU (float32), the state slots' rules
(chunks continue a slot's state, position 0 and the null slot start from zeros, other
slots are left alone) over generated cuts, and fla's kernels against the references on the
GPU."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tokenspeed.backends.kernels import state_reference

OPS = torch.ops.tokenspeed
HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu
D, W = 12, 4                                 # conv channels, kernel width
H, HV, K, V = 2, 4, 8, 6                     # key heads, value heads, head dims
SLOTS, LAYER = 6, 1


def transformers_functions():
    """transformers' torch forms. Its kernel wrappers hide them: up to 5.24 a wrapper calls
    fla wherever fla is installed (its torch function is the wrapper's ``__wrapped__``); from
    5.25 the wrapper is a module that takes the torch path for CPU tensors."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    return tuple(getattr(f, "__wrapped__", f) for f in (m.causal_conv1d_fn, m.torch_chunk_gated_delta_rule,
                                                          m.torch_recurrent_gated_delta_rule))


def sequence(length: int, seed: int, device="cpu", dtype=torch.float32) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = {"x": torch.randn(length, D, generator=gen),
         "q": torch.randn(length, H, K, generator=gen), "k": torch.randn(length, H, K, generator=gen),
         "v": torch.randn(length, HV, V, generator=gen),
         "g": -torch.rand(length, HV, generator=gen) * 0.5 - 0.05, "beta": torch.rand(length, HV, generator=gen)}
    return {name: x.to(device, dtype if name != "g" else torch.float32) for name, x in t.items()}


def weights(device="cpu", dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(D, W, generator=torch.Generator().manual_seed(7)) / W).to(device, dtype)


def pools(device="cpu", dtype=torch.float32):
    """Conv and recurrent pools of two layers, filled with garbage no fresh run may read."""
    return (torch.full((2, SLOTS, D, W), 9.0, device=device, dtype=dtype),
            torch.full((2, SLOTS, HV, K, V), 9.0, device=device))


def step(pieces: list[tuple[dict, int, int]], conv_pool, pool, weight, ops=OPS):
    """One step over ``pieces`` (a request's tensors' rows, its slot, its first position),
    laid end to end as a prefill lays its chunks; returns each piece's (conv out, out)."""
    rows = [p[0] for p in pieces]
    cat = {name: torch.cat([r[name] for r in rows]) for name in rows[0]}
    device = cat["x"].device
    row_request = torch.cat([torch.full((len(r["x"]),), i) for i, r in enumerate(rows)]).to(device)
    positions = torch.cat([torch.arange(len(r["x"])) + p[2] for r, p in zip(rows, pieces)]).to(device)
    slots = torch.cat([torch.full((len(r["x"]),), p[1]) for r, p in zip(rows, pieces)]).to(device)
    conv = ops.causal_conv_silu(cat["x"], weight, conv_pool, LAYER, slots, row_request, positions)
    out = ops.gated_delta_rule(cat["q"], cat["k"], cat["v"], cat["g"], cat["beta"], pool, LAYER, slots,
                               row_request, positions)
    bounds = torch.cumsum(torch.tensor([0] + [len(r["x"]) for r in rows]), 0).tolist()
    return [(conv[a:b], out[a:b]) for a, b in zip(bounds, bounds[1:])]


def rows(t: dict, start: int, end: int) -> dict:
    return {name: x[start:end] for name, x in t.items()}


def by_transformers(t: dict, weight: torch.Tensor):
    """transformers' whole-prompt forms: (conv out, out, final recurrent state)."""
    conv_fn, chunk_fn, _ = transformers_functions()
    conv = conv_fn(t["x"].T[None], weight, None, activation="silu")[0].T
    out, state = chunk_fn(t["q"][None], t["k"][None], t["v"][None], g=t["g"][None], beta=t["beta"][None],
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    return conv, out[0], state[0]


def test_chunks_of_three_requests_give_transformers_whole_prompts():
    """Two steps: the first takes the start of two prompts and all of a third; the second
    the rest, each continuing its slot. The recurrent state and the conv's last inputs are
    what transformers' whole prompt leaves."""
    weight, (conv_pool, pool) = weights(), pools()
    seqs = [sequence(n, seed) for seed, n in enumerate((11, 3, 70))]
    slots = (2, 5, 1)
    first = step([(rows(seqs[0], 0, 4), 2, 0), (seqs[1], 5, 0), (rows(seqs[2], 0, 33), 1, 0)], conv_pool, pool,
                 weight)
    second = step([(rows(seqs[0], 4, 11), 2, 4), (rows(seqs[2], 33, 70), 1, 33)], conv_pool, pool, weight)
    ours = [(torch.cat([first[0][0], second[0][0]]), torch.cat([first[0][1], second[0][1]])), first[1],
            (torch.cat([first[2][0], second[1][0]]), torch.cat([first[2][1], second[1][1]]))]
    for t, slot, (conv, out) in zip(seqs, slots, ours):
        want_conv, want_out, want_state = by_transformers(t, weight)
        torch.testing.assert_close(conv, want_conv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[LAYER, slot], want_state, rtol=1e-4, atol=1e-4)
        last = torch.cat([torch.zeros(max(0, W - len(t["x"])), D), t["x"][-W:]]).T
        torch.testing.assert_close(conv_pool[LAYER, slot], last)
    assert (conv_pool[0] == 9.0).all() and (pool[0] == 9.0).all(), "another layer's states were written"
    assert (pool[LAYER, [0, 3, 4]] == 9.0).all(), "a slot no request holds was written"


def test_decode_steps_continue_as_transformers_recurrent_form():
    weight, (conv_pool, pool) = weights(), pools()
    t = sequence(9, seed=3)
    step([(rows(t, 0, 6), 4, 0)], conv_pool, pool, weight)
    _, _, recurrent_fn = transformers_functions()
    _, _, state = by_transformers(rows(t, 0, 6), weight)
    for i in range(6, 9):
        (conv, out), = step([(rows(t, i, i + 1), 4, i)], conv_pool, pool, weight)
        want, state = recurrent_fn(t["q"][None, i:i + 1], t["k"][None, i:i + 1], t["v"][None, i:i + 1],
                                   g=t["g"][None, i:i + 1], beta=t["beta"][None, i:i + 1], initial_state=state[None],
                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        state = state[0]
        torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, by_transformers(t, weight)[0][-1:], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(length=st.integers(1, 20), cuts=st.lists(st.integers(1, 19), max_size=4), slot=st.integers(1, SLOTS - 1))
def test_any_cut_into_chunks_equals_one_run(length, cuts, slot):
    """A slot's state after a prompt's chunks equals the one a whole run leaves, and so do
    the outputs: what a prefix cache restores is what recomputing gives."""
    weight, t = weights(), sequence(length, seed=length)
    bounds = sorted({0, length, *[c for c in cuts if c < length]})
    whole_conv, whole_pool = pools()
    (want_conv, want_out), = step([(t, slot, 0)], whole_conv, whole_pool, weight)
    conv_pool, pool = pools()
    got = [step([(rows(t, a, b), slot, a)], conv_pool, pool, weight)[0] for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(torch.cat([c for c, _ in got]), want_conv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([o for _, o in got]), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool[LAYER, slot], whole_pool[LAYER, slot], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv_pool[LAYER, slot], whole_conv[LAYER, slot])


def test_a_step_of_no_rows_computes_nothing():
    weight, (conv_pool, pool) = weights(), pools()
    empty = sequence(0, seed=5)
    nothing = torch.zeros(0, dtype=torch.long)
    assert OPS.causal_conv_silu(empty["x"], weight, conv_pool, LAYER, nothing, nothing, nothing).shape == (0, D)
    out = OPS.gated_delta_rule(empty["q"], empty["k"], empty["v"], empty["g"], empty["beta"], pool, LAYER, nothing,
                               nothing, nothing)
    assert out.shape == (0, HV, V) and (pool == 9.0).all() and (conv_pool == 9.0).all()


def test_a_padding_row_on_the_null_slot_reads_zeros_and_leaves_live_slots_alone():
    weight, (conv_pool, pool) = weights(), pools()
    live, pad = sequence(5, seed=1), sequence(1, seed=2)
    fresh = step([(rows(pad, 0, 1), 3, 0)], *pools(), weight)[0]
    got = step([(live, 2, 0), (pad, state_reference.NULL_SLOT, 17)], conv_pool, pool, weight)
    torch.testing.assert_close(got[1][1], fresh[1])     # position 17, yet zeros: the null slot's
    alone = step([(live, 2, 0)], *pools(), weight)[0]
    torch.testing.assert_close(got[0][1], alone[1])
    assert (pool[LAYER, 1] == 9.0).all() and (pool[LAYER, 3:] == 9.0).all()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_kernels_match_the_references(dtype):
    """fla's chunked kernels (bf16 activations, float32 states) against the references,
    over the chunked three-request steps of the CPU test."""
    from tokenspeed.backends.kernels import fla_state
    weight = weights("cuda", dtype)
    seqs = [sequence(n, seed, "cuda", dtype) for seed, n in enumerate((13, 3, 70))]
    results = []
    for ops in (fla_state, state_reference):
        conv_pool, pool = pools("cuda", dtype)
        outs = step([(rows(seqs[0], 0, 4), 2, 0), (seqs[1], 5, 0), (rows(seqs[2], 0, 33), 1, 0)], conv_pool, pool,
                    weight, ops)
        outs += step([(rows(seqs[0], 4, 11), 2, 4), (rows(seqs[2], 33, 70), 1, 33)], conv_pool, pool, weight, ops)
        for i in (11, 12):   # decode-like steps: one row, shorter than the convolution
            outs += step([(rows(seqs[0], i, i + 1), 2, i)], conv_pool, pool, weight, ops)
        results.append((outs, conv_pool, pool))
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for (conv, out), (want_conv, want_out) in zip(results[0][0], results[1][0]):
        torch.testing.assert_close(conv.float(), want_conv.float(), rtol=tol, atol=tol)
        torch.testing.assert_close(out.float(), want_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(results[0][1][LAYER, 1:], results[1][1][LAYER, 1:])
    torch.testing.assert_close(results[0][2][LAYER, 1:], results[1][2][LAYER, 1:], rtol=tol, atol=tol)


def test_the_gpu_path_starts_fresh_runs_from_zeros_whatever_the_slot_holds():
    """fla's states are gathered by slot; a run at position 0 or on the null slot gets
    zeros even from a slot of NaN (never written), and the runs end where requests change."""
    from tokenspeed.backends.kernels import fla_state
    pool = torch.full((4, 2, 3), float("nan"))
    cu, slots, keep = fla_state._layout(torch.tensor([1, 1, 2, 0]), torch.tensor([0, 0, 1, 2]),
                                        torch.tensor([0, 1, 5, 3]))
    assert cu.tolist() == [0, 2, 3, 4] and slots.tolist() == [1, 2, 0] and keep.tolist() == [False, True, False]
    initial = fla_state._initial(pool, slots, keep)
    assert (initial[0] == 0).all() and (initial[2] == 0).all() and initial[1].isnan().all()


@settings(max_examples=25, deadline=None, derandomize=True)
@given(requests=st.lists(st.tuples(st.integers(0, SLOTS - 1), st.integers(0, 3)), min_size=1, max_size=SLOTS,
                         unique_by=lambda r: r[0] or object()),
       seed=st.integers(0, 2 ** 16))
def test_the_decode_forms_equal_the_run_forms_at_one_row_a_request(requests, seed):
    """A decode step (``*_step``: no host reads) against the references' runs: every slot
    continued or started as the runs would, the null slot (padding rows, any number of
    them) started from zeros, outputs and live slots equal."""
    t = sequence(len(requests), seed)
    slots = torch.tensor([s for s, _ in requests])
    positions = torch.tensor([p for _, p in requests])
    weight = weights()
    results = []
    for decode_form in (True, False):
        conv_pool, pool = pools()
        conv_pool.normal_(generator=torch.Generator().manual_seed(seed))
        pool.normal_(generator=torch.Generator().manual_seed(seed + 1))
        if decode_form:
            conv = OPS.causal_conv_silu_step(t["x"], weight, conv_pool, LAYER, slots, positions)
            out = OPS.gated_delta_rule_step(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, LAYER, slots, positions)
        else:
            row_request = torch.arange(len(requests))
            conv = OPS.causal_conv_silu(t["x"], weight, conv_pool, LAYER, slots, row_request, positions)
            out = OPS.gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, LAYER, slots, row_request,
                                       positions)
        results.append((conv, out, conv_pool, pool))
    (conv, out, conv_pool, pool), (conv_ref, out_ref, conv_pool_ref, pool_ref) = results
    torch.testing.assert_close(conv, conv_ref)
    torch.testing.assert_close(out, out_ref)
    live = slots[slots != 0].unique()
    torch.testing.assert_close(conv_pool[:, live], conv_pool_ref[:, live])
    torch.testing.assert_close(pool[:, live], pool_ref[:, live])
    untouched = [s for s in range(1, SLOTS) if s not in live.tolist()]
    assert torch.equal(pool[:, untouched], pool_ref[:, untouched])


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32),
                                           pytest.param("cuda", torch.float32, marks=gpu),
                                           pytest.param("cuda", torch.bfloat16, marks=gpu)])
def test_flas_decode_step_matches_the_reference_step(device, dtype):
    """fla's recurrent kernel for serving (decode's CUDA form, in place by slot; on the CPU
    under the Triton interpreter) against the torch step: live rows continuing their slots,
    one at position 0 over a slot of garbage, two padding rows on the null slot."""
    from tokenspeed.backends.kernels import fla_state
    if device == "cuda" and not HAS_CUDA:
        pytest.skip("needs a GPU")
    slots = torch.tensor([3, 1, 5, 0, 0], device=device)
    positions = torch.tensor([7, 0, 2, 0, 0], device=device)
    t = sequence(len(slots), 11, device, dtype)
    results = []
    for ops in (fla_state, state_reference):
        _, pool = pools(device, dtype)
        pool.normal_(generator=torch.Generator(device).manual_seed(3))
        out = ops.gated_delta_rule_step(t["q"], t["k"], t["v"], t["g"], t["beta"], pool, LAYER, slots, positions)
        results.append((out, pool))
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(results[0][0][:3].float(), results[1][0][:3].float(), rtol=tol, atol=tol)
    torch.testing.assert_close(results[0][1][:, 1:], results[1][1][:, 1:], rtol=tol, atol=tol)
