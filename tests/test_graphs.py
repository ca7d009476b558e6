"""Graph capture and replay through the CPU stand-in (DESIGN.md invariants 1, 4 and 5)."""

import logging

import pytest
import torch

import tokenspeed as ts
from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.backends.paged import CacheGroupRouter, PagedAttentionBackend
from tokenspeed.backends.support import CudaGraphSupport
from tokenspeed.models.random import TINY_LLAMA, random_model
from tokenspeed.runtime.graphs import (GraphCaptureError, GraphCapturer, LateCaptureError,
                                       MovedTensorError)

GREEDY = ts.SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def model():
    return random_model(TINY_LLAMA, seed=3)


def make_llm(model, **kw):
    kw = {"max_num_seqs": 6, "max_num_batched_tokens": 64, "page_size": 4, **kw}
    return ts.LLM(model, **kw)


def prompts(n, base=1):
    return [[(base + 7 * i + j) % 500 for j in range(3 + 5 * i)] for i in range(n)]


def fill(llm, n):
    """Prefill ``n`` requests straight through the prefill runner; their decode rows."""
    rows, pages = [], iter(range(1, llm.num_pages))
    for p in prompts(n):
        owned = tuple(next(pages) for _ in range(-(-(len(p) + 1) // llm.page_size)))
        [token] = llm.prefill.run([ExtendChunk(tuple(p), 0, owned, True)], [GREEDY])
        rows.append(DecodeRow(token, len(p), owned))
    return rows


@pytest.mark.parametrize("capture_sizes", [None, (1, 2, 4)])
def test_decode_replay_equals_eager_for_every_size(model, capture_sizes):
    graphs, eager = make_llm(model, capture_sizes=capture_sizes), make_llm(model, enforce_eager=True)
    assert graphs.decode.graphs and not eager.decode.graphs
    for bs in range(1, 7):  # every rung, sizes between rungs, and above (1, 2, 4)
        with torch.inference_mode():
            got = graphs.decode.run(fill(graphs, bs), [GREEDY] * bs)
            want = eager.decode.run(fill(eager, bs), [GREEDY] * bs)
        assert got == want, f"bs={bs}"


def test_padded_replay_and_eager_give_equal_live_logits(model):
    llm = make_llm(model)
    with torch.inference_mode():
        rows = fill(llm, 3)
        before = llm.kv_cache.clone()
        llm.decode.slots.publish(llm.decode.refresh(rows, 4))
        llm.decode.sampling.publish(llm.decode._sampling([GREEDY] * 4, 4))
        replayed = llm.decode.graphs[4].replay()[:3].clone()
        unpadded = llm.decode.slots.publish(llm.decode.refresh(rows, 3))
        torch.testing.assert_close(llm.lowered["decode"](before, unpadded), replayed, rtol=0, atol=0)


def test_prefill_guard_names_a_moved_slot(model):
    llm = make_llm(model)
    slots = llm.prefill.slots
    slots.buffers = {n: b.clone() for n, b in slots.buffers.items()}  # every slot moves
    slots._views.clear()
    chunks = [ExtendChunk(tuple(range(10, 21)), 0, (1, 2, 3), True)]
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="input_ids|positions|slot_mapping"):
        llm.prefill.run(chunks, [GREEDY])


@pytest.mark.parametrize("max_num_seqs,capture_sizes", [(6, None), (5, (1, 2))])
def test_generate_matches_eager_with_graphs_on(model, max_num_seqs, capture_sizes):
    kw = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 16}
    on = make_llm(model, capture_sizes=capture_sizes, **kw).generate(prompts(9), GREEDY)
    off = make_llm(model, enforce_eager=True, **kw).generate(prompts(9), GREEDY)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_views_are_built_once_and_never_move(model):
    llm = make_llm(model)
    first = {n: t.data_ptr() for n, t in llm.decode.slots.view(4).items()}
    with torch.inference_mode():
        llm.generate(prompts(5), GREEDY)
    assert llm.decode.slots.view(4) is llm.decode.slots.view(4)
    assert {n: t.data_ptr() for n, t in llm.decode.slots.view(4).items()} == first


def test_guard_names_a_moved_tensor(model):
    llm = make_llm(model)
    view = llm.decode.slots.view(2)
    view["positions"] = view["positions"].clone()  # a slot that no longer is the captured one
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="meta.positions"):
        llm.decode.run(fill(llm, 2), [GREEDY] * 2)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_second_engine_over_the_model_leaves_the_first_engines_graphs_valid(dtype):
    """``ts.LLM`` moves (and casts) the model; that must not replace a buffer (the rotary
    frequencies did), or the first engine's graphs read freed memory on the GPU."""
    model = random_model(TINY_LLAMA, seed=3)
    first = make_llm(model, dtype=dtype)
    want = first.generate(prompts(3), GREEDY)
    make_llm(model, dtype=dtype)
    with torch.inference_mode():
        assert [o.token_ids for o in first.generate(prompts(3), GREEDY)] == [o.token_ids for o in want]


def test_guard_names_a_replaced_buffer_or_weight():
    model = random_model(TINY_LLAMA, seed=3)
    llm = make_llm(model)
    rotary = model.model.layers[0].self_attn.rotary
    rotary.inv_freq = rotary.inv_freq.clone()  # read by the prefill graphs
    chunks = [ExtendChunk(tuple(range(10, 21)), 0, (1, 2, 3), True)]
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="inv_freq"):
        llm.prefill.run(chunks, [GREEDY])
    llm = make_llm(model)
    with torch.inference_mode():
        rows = fill(llm, 1)
    embed = model.model.embed_tokens
    embed.weight = torch.nn.Parameter(embed.weight.detach().clone())  # read by decode graphs
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="embed_tokens"):
        llm.decode.run(rows, [GREEDY])


def test_capture_after_startup_is_an_error(model):
    llm = make_llm(model)
    with pytest.raises(LateCaptureError, match="after startup"):
        llm.decode.capture(GraphCapturer_sealed(), (1,))


def GraphCapturer_sealed():
    capturer = GraphCapturer("cpu")
    capturer.seal()
    return capturer


def test_a_failing_capture_is_fatal():
    def broken():
        raise RuntimeError("kernel launch failed")
    with pytest.raises(GraphCaptureError, match="decode.bs=1. failed"):
        GraphCapturer("cpu").capture("decode[bs=1]", broken, reach=dict)


class EagerOnlyLeaf(PagedAttentionBackend):
    cuda_graph_support = CudaGraphSupport(decode_graph=False, prefill_graph=True)


def test_support_resolution_logs_the_culprit_and_downgrades(model, caplog):
    router = CacheGroupRouter([PagedAttentionBackend(), EagerOnlyLeaf()])
    with caplog.at_level(logging.WARNING, logger="tokenspeed.backends"):
        llm = make_llm(model, backend=router)
    assert "EagerOnlyLeaf does not support decode_graph" in caplog.text
    assert llm.support == CudaGraphSupport(decode_graph=False, prefill_graph=True)
    assert not llm.decode.graphs and llm.prefill.graphs
    assert any(s.kind == "break" for s in llm.lowered["decode"].segments)
    eager = make_llm(model, enforce_eager=True)
    assert [o.token_ids for o in llm.generate(prompts(4), GREEDY)] == \
        [o.token_ids for o in eager.generate(prompts(4), GREEDY)]


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 40, 64, 65, 90])
def test_prefill_replay_equals_eager(model, num_tokens):
    graphs, eager = make_llm(model), make_llm(model, enforce_eager=True)
    chunks = [ExtendChunk(tuple((5 * i) % 500 for i in range(num_tokens)), 0,
                          tuple(range(1, 2 + num_tokens // 4)), True)]
    with torch.inference_mode():
        assert graphs.prefill.run(chunks, [GREEDY]) == eager.prefill.run(chunks, [GREEDY])
        # page 0 is the null page padding rows write into; padded matrix shapes may round
        # differently in the last bit, so live pages are compared to float32 precision
        live_pages = slice(1, None)
        torch.testing.assert_close(graphs.kv_cache[:, :, live_pages], eager.kv_cache[:, :, live_pages],
                                   rtol=1e-5, atol=1e-6)


def test_prefill_graphs_cover_every_bucket_and_row_rung(model):
    llm = make_llm(model)
    keys = set(llm.prefill.graphs)
    for seg in llm.lowered["prefill"].segments:
        if seg.kind == "graph":
            ladder = llm.startup.token_buckets if seg.rows == "tokens" else llm.startup.row_buckets
            assert {(seg.name, size) for size in ladder} <= keys


def test_row_bucket_graphs_are_captured_after_every_token_bucket_graph(model):
    """Graphs share one pool, where a later capture may keep outputs in an earlier one's
    temporaries: a walk replays token graphs then row graphs, so that must be the order."""
    llm = make_llm(model)
    rows = {seg.name: seg.rows for seg in llm.lowered["prefill"].segments}
    order = [rows[name] for name, _ in llm.prefill.graphs]      # dicts keep capture order
    assert set(order) == {"tokens", "view"}
    assert order == sorted(order, key=["tokens", "view"].index)


def test_padded_rows_are_scrubbed_after_each_break(model):
    llm = make_llm(model)
    chunks = [ExtendChunk(tuple(range(10, 21)), 0, (1, 2, 3), True)]  # 11 tokens -> bucket 16
    with torch.inference_mode():
        llm.prefill.run(chunks, [GREEDY])
    attention_outputs = {o for s in llm.lowered["prefill"].segments if s.name.endswith("attention")
                         for o in s.outputs}
    checked = 0
    for (name, size), (_, static, _) in llm.prefill.graphs.items():
        for value in attention_outputs & set(static):
            if size == 16 and static[value].shape[0] == 16:
                assert bool((static[value][11:] == 0).all()), f"{value} padded rows not scrubbed"
                checked += 1
    assert checked >= 1


def test_a_dry_step_leaves_the_sampling_state_as_it_was(model):
    llm = make_llm(model)
    runner, sample = llm.decode, ts.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    with torch.inference_mode():
        before = (runner.seeds.get_state(), runner.generator.get_state(), runner.step.clone())
        runner.dry_step(4)
        after = (runner.seeds.get_state(), runner.generator.get_state(), runner.step)
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    dried = llm.generate(prompts(3), sample)
    assert [o.token_ids for o in dried] == [o.token_ids for o in make_llm(model).generate(prompts(3), sample)]


def test_the_dry_run_walks_until_two_quiet_walks_then_the_largest():
    from tokenspeed.runtime.startup import _walk_until_quiet
    new_at = {16: "a", 32: "b", 64: "c"}  # the variant each size brings, if any
    walked, variants = [], []

    def walk(size):
        walked.append(size)
        variants.extend([new_at[size]] if size in new_at else ["a"])

    _walk_until_quiet(walk, [128, 16, 48, 32, 80, 96, 64, 2048], variants)
    assert walked == [16, 32, 48, 64, 80, 96, 2048]
    walked.clear()
    _walk_until_quiet(walk, [16, 32], variants)
    assert walked == [16, 32]
