"""Graph capture and replay through the CPU stand-in (docs/DESIGN.md invariants 1, 4, 5).

Replays are padded to a rung, eager runs are not: logits are compared to a tolerance that
bounds accumulation-order differences, and greedy tokens on a model whose margins are
checked to exceed it.
"""

import logging
import re

import pytest
import torch

import tokenspeed as ts
from tokenspeed.backends.metadata import DecodeRow, ExtendChunk
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.backends.support import CudaGraphSupport
from tokenspeed.errors import InternalError
from tokenspeed.execution.sampler import RowSampling
from tokenspeed.execution.graphs import (GraphCaptureError, GraphCapturer, LateCaptureError,
                                       MovedTensorError)

from margins import ROW_COUNT_TOLERANCE, assert_decisive, decisive_model, greedy_margins

GREEDY = ts.SamplingParams(temperature=0.0, max_tokens=6)
ROW = RowSampling(GREEDY, seed=0)


@pytest.fixture(scope="module")
def model():
    return decisive_model(seed=3)


def make_llm(model, **kw):
    """The CPU stand-in captures unless ``enforce_eager``; short ladders keep it quick."""
    kw = {"max_num_seqs": 6, "max_num_batched_tokens": 64, "page_size": 4,
          "graphs": not kw.pop("enforce_eager", False), **kw}
    return ts.LLM(model, **kw)


@pytest.fixture(scope="module")
def graphed(model):
    return make_llm(model)


@pytest.fixture(scope="module")
def eager(model):
    return make_llm(model, enforce_eager=True)


class AttentionBreaksLeaf(PagedAttentionBackend):
    """Prefill attention runs eagerly between the graphs (the lowering with breaks)."""
    cuda_graph_support = CudaGraphSupport(prefill_attention=False)


@pytest.fixture(scope="module")
def broken(model):
    return make_llm(model, backend=AttentionBreaksLeaf())


def prompts(n, base=1):
    return [[(base + 7 * i + j) % 500 for j in range(3 + 5 * i)] for i in range(n)]


def fill(llm, n):
    """Prefill ``n`` requests straight through the prefill runner; their decode rows."""
    rows, pages, page_size = [], iter(range(1, llm.compiled.num_pages)), llm.compiled.config.page_size
    for p in prompts(n):
        owned = tuple(next(pages) for _ in range(-(-(len(p) + 1) // page_size)))
        [token] = llm.compiled.prefill.run([ExtendChunk(tuple(p), 0, owned, True)], [ROW])
        rows.append(DecodeRow(token, len(p), owned))
    return rows


@pytest.mark.parametrize("capture_sizes", [None, (1, 2, 4)])
def test_decode_replay_equals_eager_for_every_size(model, eager, capture_sizes, monkeypatch):
    graphs = make_llm(model, capture_sizes=capture_sizes)
    assert graphs.compiled.decode.graphs and not eager.compiled.decode.graphs
    margins = greedy_margins(monkeypatch)
    for bs in range(1, 7):  # every rung, sizes between rungs, and above (1, 2, 4)
        with torch.inference_mode():
            rows = fill(eager, bs)
            del margins[:]  # the decode step's margins only
            want = eager.compiled.decode.run(rows, [ROW] * bs)
            assert_decisive(margins)
            got = graphs.compiled.decode.run(fill(graphs, bs), [ROW] * bs)
        assert got == want, f"bs={bs}"


def test_padded_replay_and_eager_give_equal_live_logits(graphed):
    decode = graphed.compiled.decode
    with torch.inference_mode():
        rows = fill(graphed, 3)
        before = graphed.compiled.kv_cache.clone()
        decode.slots.publish(decode.refresh(rows, 4))
        decode.sampling.publish(decode._padded([ROW] * 4, 4))
        replayed = decode.graphs[4].replay()[:3].clone()
        unpadded = decode.slots.publish(decode.refresh(rows, 3))
        eager = graphed.compiled.lowered["decode"](before, unpadded)
    torch.testing.assert_close(eager, replayed, rtol=0, atol=ROW_COUNT_TOLERANCE)
    assert not torch.equal(eager, torch.zeros_like(eager))


def test_prefill_guard_names_a_moved_slot(model):
    llm = make_llm(model)
    slots = llm.compiled.prefill.slots
    slots.buffers = {n: b.clone() for n, b in slots.buffers.items()}  # every slot moves
    slots._views.clear()
    slots._field_views.clear()
    chunks = [ExtendChunk(tuple(range(10, 21)), 0, (1, 2, 3), True)]
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="input_ids|positions|slot_mapping"):
        llm.compiled.prefill.run(chunks, [ROW])


@pytest.mark.parametrize("max_num_seqs,capture_sizes", [(6, None), (5, (1, 2))])
def test_generate_matches_eager_with_graphs_on(model, max_num_seqs, capture_sizes, monkeypatch):
    kw = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": 16}
    on = make_llm(model, capture_sizes=capture_sizes, **kw).generate(prompts(9), GREEDY)
    off = make_llm(model, enforce_eager=True, **kw)
    margins = greedy_margins(monkeypatch)
    off = off.generate(prompts(9), GREEDY)
    assert_decisive(margins)
    assert [o.token_ids for o in on] == [o.token_ids for o in off]


def test_views_are_built_once_and_never_move(graphed):
    decode = graphed.compiled.decode
    first = {n: t.data_ptr() for n, t in decode.slots.view(4).items()}
    graphed.generate(prompts(5), GREEDY)
    assert decode.slots.view(4) is decode.slots.view(4)
    assert {n: t.data_ptr() for n, t in decode.slots.view(4).items()} == first


def test_guard_names_a_moved_tensor(model):
    llm = make_llm(model)
    view = llm.compiled.decode.slots.view(2)
    view["positions"] = view["positions"].clone()  # a slot that no longer is the captured one
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="meta.positions"):
        llm.compiled.decode.run(fill(llm, 2), [ROW] * 2)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_a_second_engine_over_the_model_leaves_the_first_engines_graphs_valid(dtype):
    """``ts.LLM`` moves (and casts) the model; that must not replace a buffer (the rotary
    frequencies did), or the first engine's graphs read freed memory on the GPU."""
    model = decisive_model(seed=3)
    first = make_llm(model, dtype=dtype)
    want = first.generate(prompts(3), GREEDY)
    make_llm(model, dtype=dtype)
    assert [o.token_ids for o in first.generate(prompts(3), GREEDY)] == [o.token_ids for o in want]


def test_guard_names_a_replaced_weight():
    model = decisive_model(seed=3)
    embed = model.model.embed_tokens
    llm = make_llm(model)
    embed.weight = torch.nn.Parameter(embed.weight.detach().clone())  # read by the prefill graphs (the encoder)
    chunks = [ExtendChunk(tuple(range(10, 21)), 0, (1, 2, 3), True)]
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="embed_tokens"):
        llm.compiled.prefill.run(chunks, [ROW])
    llm = make_llm(model)
    with torch.inference_mode():
        rows = fill(llm, 1)
    embed.weight = torch.nn.Parameter(embed.weight.detach().clone())  # read by decode graphs
    with torch.inference_mode(), pytest.raises(MovedTensorError, match="embed_tokens"):
        llm.compiled.decode.run(rows, [ROW])


def test_capture_after_startup_is_an_error(graphed):
    with pytest.raises(LateCaptureError, match="after startup"):
        graphed.compiled.decode.capture(sealed_capturer(), (1,))


def sealed_capturer():
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


class TwoLeaves(PagedAttentionBackend):
    def child_backends(self):
        return (PagedAttentionBackend(), EagerOnlyLeaf())


def test_support_resolution_logs_the_culprit_and_downgrades(model, eager, caplog):
    with caplog.at_level(logging.WARNING, logger="tokenspeed.backends"):
        llm = make_llm(model, backend=TwoLeaves())
    assert "EagerOnlyLeaf does not support decode_graph" in caplog.text
    assert "EagerOnlyLeaf does not support prefill_attention" in caplog.text   # it did not opt in
    assert llm.compiled.support == CudaGraphSupport(decode_graph=False, prefill_graph=True)
    assert not llm.compiled.decode.graphs and llm.compiled.prefill.graphs
    assert any(s.kind == "break" for s in llm.compiled.lowered["decode"].segments)
    assert any(s.name.endswith("attention") for s in llm.compiled.lowered["prefill"].segments)
    assert [o.token_ids for o in llm.generate(prompts(4), GREEDY)] == \
        [o.token_ids for o in eager.generate(prompts(4), GREEDY)]


@pytest.mark.parametrize("lowering", ["graphed", "broken"])
@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 40, 64, 65, 90])
def test_prefill_replay_equals_eager(lowering, eager, num_tokens, monkeypatch, request):
    """Token buckets 16..64: a bucket, between buckets, and above the largest (eager);
    attention captured in the stages' graphs, and run eagerly between graphs."""
    graphed = request.getfixturevalue(lowering)
    pages = tuple(range(1, 2 + num_tokens // 4))
    chunks = [ExtendChunk(tuple((5 * i) % 500 for i in range(num_tokens)), 0, pages, True)]
    margins = greedy_margins(monkeypatch)
    with torch.inference_mode():
        want = eager.compiled.prefill.run(chunks, [ROW])
        assert_decisive(margins)
        assert graphed.compiled.prefill.run(chunks, [ROW]) == want
    slots = torch.tensor([pages[p // 4] * 4 + p % 4 for p in range(num_tokens)])
    written = [llm.compiled.kv_cache.flatten(2, 3)[:, :, slots] for llm in (graphed, eager)]
    torch.testing.assert_close(*written, rtol=0, atol=ROW_COUNT_TOLERANCE)


def test_prefill_attention_is_captured_in_one_graph_per_stage(graphed, broken):
    """The paged backend's prefill attention reads a tile plan padded to the bucket, so a
    stage is one graph; a backend without that support breaks at every attention."""
    segments = graphed.compiled.lowered["prefill"].segments
    assert [(s.stage, s.kind) for s in segments] == \
        [("encoder", "graph"), ("narrowing", "break"), ("decoder", "graph"), ("finish", "break")]
    text = "\n".join(s.graph_module.code for s in segments)
    assert "extend_attention" in text
    attentions = [s for s in broken.compiled.lowered["prefill"].segments if s.name.endswith("attention")]
    assert len(attentions) == graphed.config.num_layers and {s.kind for s in attentions} == {"break"}


def test_captured_attention_reads_a_table_of_fixed_rows(graphed, broken):
    """Its graphs read the table from a slot with a row for each chunk a step may hold (6)
    and the null row; each step's table fills its first rows. The tile plan is sized for
    as many chunks: a step of more is refused, never cut."""
    chunks = [ExtendChunk((5, 6, 7), 0, (1,), True)]
    runner = graphed.compiled.prefill
    assert runner.plan(chunks, 16).block_tables.shape[0] == len(chunks) + 1
    with torch.inference_mode():
        assert runner.slots.publish(runner.plan(chunks, 16)).block_tables.shape[0] == 6 + 1
    assert len(broken.compiled.prefill.plan(chunks, 16).attention_tiles) == 1 + 1 + 1
    with pytest.raises(InternalError, match="7 chunks in one step; a step holds at most 6"):
        runner.plan([chunks[0]] * 7, 32)


@pytest.mark.parametrize("bucket", [16, 32, 64])
def test_the_table_and_tile_plan_are_published_into_pinned_slots(graphed, bucket):
    """Captured attention reads them where every graph was captured: one table for every
    bucket (a step's rows first, an earlier step's after them), a tile plan sized by the
    bucket, each step's values copied in."""
    runner = graphed.compiled.prefill
    wide = [ExtendChunk((i,), 0, (i + 1,), True) for i in range(5)]
    chunks = [ExtendChunk(tuple(range(9)), 0, (1, 2, 3), True), ExtendChunk((4, 5), 3, (4, 5), False)]
    with torch.inference_mode():
        runner.slots.publish(runner.plan(wide, bucket, 5))
        meta = runner.plan(chunks, bucket, 2)
        view = runner.slots.publish(meta)
    for name in ("attention_tiles", "input_ids", "row_request"):
        assert torch.equal(getattr(view, name), getattr(meta, name)), name
    assert torch.equal(view.block_tables[:3], meta.block_tables)
    assert view.block_tables[2].eq(0).all() and view.block_tables[3:5].ne(0).any()   # the null row, then stale
    assert view.block_tables is runner.slots.view(16)["block_tables"]
    assert len(view.attention_tiles) == -(-bucket // 64) + 6 + 1   # a partial tile per chunk (6 at most)


def test_view_buckets_above_the_token_buckets_capture_and_replay(model):
    """Views of 4 rows per request for 6 requests pass the one token bucket (16): their
    graphs read the table, pinned for every batch, and no token rows."""
    options = dict(max_num_batched_tokens=16, view_width=4)
    llm = make_llm(model, **options)
    assert max(llm.compiled.startup.view_buckets) > max(llm.compiled.startup.token_buckets)
    assert [o.token_ids for o in llm.generate(prompts(4), GREEDY)] == \
        [o.token_ids for o in make_llm(model, enforce_eager=True, **options).generate(prompts(4), GREEDY)]


def test_padded_rows_are_scrubbed_after_each_break(broken):
    chunks = [ExtendChunk(tuple(range(10, 21)), 0, (1, 2, 3), True)]  # 11 tokens -> bucket 16
    with torch.inference_mode():
        broken.compiled.prefill.run(chunks, [ROW])
    attention_outputs = {o for s in broken.compiled.lowered["prefill"].segments
                         if s.name.endswith("attention") for o in s.outputs}
    checked = 0
    for (name, size), entry in broken.compiled.prefill.graphs.graphs.items():
        for value in attention_outputs & set(entry.static_inputs):
            if size == 16 and entry.static_inputs[value].shape[0] == 16:
                assert bool((entry.static_inputs[value][11:] == 0).all()), f"{value} not scrubbed"
                checked += 1
    assert checked >= 1


def test_a_dry_step_changes_no_later_sample(model):
    """The startup's dry run (recording kernel variants) must not shift any sample."""
    llm = make_llm(model)
    sample = ts.SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    with torch.inference_mode():
        llm.compiled.decode.dry_step(4)
    dried = llm.generate(prompts(3), sample)
    assert [o.token_ids for o in dried] == [o.token_ids for o in make_llm(model).generate(prompts(3), sample)]


def test_a_cpu_engine_captures_nothing_unless_asked(model):
    llm = ts.LLM(model, page_size=4, max_num_seqs=4)
    assert llm.compiled.startup.num_graphs == 0 and not llm.compiled.decode.graphs
    assert "every batch runs eagerly" in llm.compiled.as_text()
    stand_in = make_llm(model)
    assert re.search(r"00.decode.graph +graph +ladder=batch", stand_in.compiled.as_text())
    assert all(g.kernels is None for g in stand_in.compiled.decode.graphs.values())
    assert "kernels a step: not counted (the CPU stand-in launches no device kernels)" in stand_in.compiled.as_text()


def test_as_text_prints_each_graphs_kernels_by_rows(model):
    """The line as a GPU prints it, from counts set on the stand-in's graphs."""
    llm = make_llm(model)
    graphs = llm.compiled.decode.graphs
    for rows, captured in graphs.items():
        captured.graph.kernels, captured.graph.uncounted = 100 + rows, None
    layers = model.config.num_layers
    counts = ", ".join(f"{rows}: {100 + rows}" for rows in sorted(graphs))
    assert (f"kernels a step, by rows: {counts} ({101 / layers:.1f} a layer at 1 rows over {layers} layers"
            in llm.compiled.as_text())
    graphs[max(graphs)].graph.kernels, graphs[max(graphs)].graph.uncounted = None, "driver error 400"
    assert "kernels a step: not counted (driver error 400)" in llm.compiled.as_text()


def test_the_dry_run_walks_until_two_quiet_walks_then_the_largest():
    from tokenspeed.execution.startup import _walk_until_quiet
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


def test_the_collector_is_paused_while_an_engine_starts_and_restored_after(model, monkeypatch):
    """``collector_paused``: no cyclic collection walks the startup's objects, and the
    collector's state is put back after a start and after a failed one (it stays off for a
    caller who had turned it off)."""
    import gc
    from tokenspeed import stages
    seen, trace = [], stages.trace
    monkeypatch.setattr(stages, "trace", lambda m: seen.append(gc.isenabled()) or trace(m))
    make_llm(model)
    assert seen == [False] and gc.isenabled()

    def fails(m):
        raise RuntimeError("tracing failed")
    monkeypatch.setattr(stages, "trace", fails)
    with pytest.raises(RuntimeError, match="tracing failed"):
        make_llm(model)
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(RuntimeError, match="tracing failed"):
            make_llm(model)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_start_described_alike_skips_the_kernel_dry_run(model, tmp_path, monkeypatch):
    """A start records its kernel variants in a dry run, then marks its description (the
    programs, shapes and ladders) in Triton's cache; a later start described alike finds
    the mark and skips the dry run. Another ladder or another cache is another start."""
    from tokenspeed.backends.kernels import precompile
    from tokenspeed.execution import startup
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    dry_runs, dry_run = [], precompile.dry_run
    monkeypatch.setattr(precompile, "dry_run", lambda: dry_runs.append(1) or dry_run())

    def precompiled(llm) -> int:
        compiled = llm.compiled
        steps = [(compiled.decode, compiled.startup.decode_ladder)]
        return startup._precompile(steps, compiled.prefill, 1, precompile.CompileWorkers(0))

    llm = make_llm(model)
    assert precompiled(llm) == 0 and dry_runs == [1]    # the CPU records no Triton variant
    assert precompiled(make_llm(model)) == 0 and dry_runs == [1]
    described = startup.start_description([(llm.compiled.decode, llm.compiled.startup.decode_ladder)],
                                          llm.compiled.prefill)
    assert precompile.start_marker(described).exists()
    other = make_llm(model, max_num_seqs=3)
    assert precompiled(other) == 0 and dry_runs == [1, 1]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert not precompile.start_marker(described).exists()


def test_eager_steps_call_the_kernels_without_the_dispatcher(model):
    """An eager decode step (as a prefill's eager segments) calls its IR ops' kernels
    directly: no ``tokenspeed::`` op passes the dispatcher, whose wrappers cost more than
    many of the CPU's kernels, and the tokens are the dispatched program's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    llm = make_llm(model, enforce_eager=True)
    prompts = [[5, 9, 11, 3], [7, 2, 8]]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    with Dispatched() as seen:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert tokens == expected and any(op.startswith("aten.") for op in seen.ops)
    assert not [op for op in seen.ops if op.startswith("tokenspeed.")]
    runner = llm.compiled.decode
    view = runner.idle_inputs(2)[0]
    with torch.inference_mode():
        assert torch.equal(runner._model(view), runner.program(runner.kv_cache, view))


def test_direct_calls_read_each_weight_with_one_lookup():
    """The eager copy of a segment holds each weight it reads as an attribute of its own
    (the same tensor, not a copy), not behind a path of modules, and computes the same."""
    from torch import fx
    from tokenspeed.backends.kernels.registry import direct_calls

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4))
            self.register_buffer("scale", torch.tensor(2.0))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return x * self.inner.weight + self.inner.scale * self.inner.weight

    gm = fx.symbolic_trace(Outer())
    direct = direct_calls(gm, "cpu")
    x = torch.randn(3, 4)
    assert "self.inner" not in direct.code and torch.equal(direct(x), gm(x))
    assert direct.direct_inner_weight is gm.inner.weight and direct.direct_inner_scale is gm.inner.scale

    class Clash(Outer):   # already holds the name the copy would give inner.weight
        def __init__(self):
            super().__init__()
            self.direct_inner_weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return super().forward(x) + self.direct_inner_weight

    with pytest.raises(InternalError, match="direct_inner_weight"):
        direct_calls(fx.symbolic_trace(Clash()), "cpu")
