"""Traced and lowered programs compute what the module computes; the narrowing keeps the
sampled rows exact (docs/DESIGN.md invariant 7); the lowered structure is what the passes say."""

import operator
import re

import pytest
import torch

import tokenspeed as ts
from tokenspeed.backends.metadata import DecodeRow, ExtendChunk, plan_extend, refresh_decode
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.backends.support import CudaGraphSupport
from tokenspeed.ir.ops import ATTENTION_TARGETS, OPS, ROPE_WRITE_KV, WRITE_KV_TARGETS
from tokenspeed.models.random import TINY_LLAMA, random_model
from tokenspeed.passes.split_merge import SPLIT_COUNTER_SLOTS, SPLIT_COUNTERS, SPLITTING
from tokenspeed.execution import kv_pool

PAGE = 4
KV_SHARED = {**TINY_LLAMA, "num_hidden_layers": 4, "num_kv_shared_layers": 2}


@pytest.fixture(scope="module", params=["plain", "kv_shared"])
def model(request):
    return random_model(TINY_LLAMA if request.param == "plain" else KV_SHARED, seed=1)


def cache(model, pages=32):
    return kv_pool.allocate(kv_pool.geometry_for(model.config, PAGE, torch.float32, "cpu"), pages)


def two_requests(width=1, first_start=0):
    """A completing chunk with a cached prefix and an open chunk, padded by 3 rows."""
    chunks = [ExtendChunk(tuple(range(7, 20)), first_start, (1, 2, 3, 4, 5, 6, 7, 8), True),
              ExtendChunk(tuple(range(30, 36)), 0, (9, 10), False),
              ExtendChunk((3, 4, 5), 0, (11,), True)]
    return plan_extend(chunks, num_rows=25, num_table_rows=4, max_pages=8, page_size=PAGE,
                       view_width=width, num_view_rows=7)


def run_twice(fn, model, meta, prefix=None):
    """Run ``fn`` on a cache that already holds ``prefix`` (written by the module)."""
    kv = cache(model)
    with torch.no_grad():
        if prefix is not None:
            model(kv, prefix)
        return fn(kv, meta), kv


@pytest.mark.parametrize("width", [1, 3])
def test_lowered_prefill_equals_module(model, width):
    prefix = plan_extend([ExtendChunk(tuple(range(40, 45)), 0, (1, 2), True)], 5, 2, 8, PAGE)
    meta = two_requests(width, first_start=5)
    traced = ts.trace(model)
    expected, kv_module = run_twice(model, model, meta, prefix)
    for lowered in (traced.lower("prefill"), traced.lower("prefill", attention_breaks=True),
                    traced.lower("prefill", narrow=False)):
        got, kv = run_twice(lowered, model, meta, prefix)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv[:, :, 1:], kv_module[:, :, 1:], rtol=0, atol=0)
    got, _ = run_twice(traced, model, meta, prefix)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_lowered_decode_equals_module(model):
    prefix = plan_extend([ExtendChunk(tuple(range(9)), 0, (1, 2, 3), True),
                          ExtendChunk((4, 5), 0, (4,), True)], 11, 3, 8, PAGE)
    meta = refresh_decode([DecodeRow(11, 9, (1, 2, 3)), DecodeRow(12, 2, (4,))], 4, 8, PAGE)
    expected, _ = run_twice(model, model, meta, prefix)
    got, _ = run_twice(ts.trace(model).lower("decode"), model, meta, prefix)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_unnarrowed_prefill_has_a_break_per_layer(model):
    lowered = ts.trace(model).lower("prefill", narrow=False)
    kinds = [s.kind for s in lowered.segments]
    layers = model.config.num_layers
    assert kinds.count("break") == layers and kinds.count("graph") == layers + 1
    assert kinds == ["graph", "break"] * layers + ["graph"]


def test_attention_inside_prefill_graphs_needs_the_narrowing(model):
    """Without the stages, the sampled rows' gather (its rows vary per step) would be
    captured with the last attention."""
    with pytest.raises(ValueError, match="needs the narrowing"):
        ts.trace(model).lower("prefill", narrow=False, attention_breaks=False)


@pytest.mark.parametrize("mode, option, value, message", [
    ("decode", "attention_breaks", True, "attention_breaks lowers prefill only; decode's options are decode_graph"),
    ("decode", "narrow", False, "narrow lowers prefill only"),
    ("verify", "attention_breaks", False, "attention_breaks lowers prefill only"),
    ("prefill", "decode_graph", False, "decode_graph lowers decode and verify only"),
])
def test_an_option_of_another_mode_is_refused_not_ignored(model, mode, option, value, message):
    with pytest.raises(ValueError, match=message):
        ts.trace(model).lower(mode, **{option: value})


@pytest.mark.parametrize("option, value", [("narrow", "no"), ("narrow", 0), ("attention_breaks", 1)])
def test_a_lowering_option_must_be_a_bool(model, option, value):
    """``narrow="no"`` is truthy: it would narrow; ``narrow=0`` would silently not."""
    with pytest.raises(TypeError, match=re.escape(f"lower('prefill', {option}={value!r}): must be True, False or None")):
        ts.trace(model).lower("prefill", **{option: value})


def test_a_backend_that_cannot_capture_prefill_attention_refuses_it_in_a_graph(model):
    class Breaking(PagedAttentionBackend):
        cuda_graph_support = CudaGraphSupport(prefill_attention=False)
    traced = ts.trace(model)
    with pytest.raises(ValueError, match="segment 00.encoder.graph holds one: lower prefill with attention_breaks"):
        ts.compile(traced.lower("prefill"), traced.lower("decode"), ts.CompileConfig(num_kv_pages=8),
                   backend=Breaking())


def test_prefill_and_decode_of_different_models_are_refused_before_a_pool_is_bound(model):
    """The pool is laid out by decode's model: another model's prefill would write keys of
    another shape (here another head size and layer count) into it."""
    other = random_model({**TINY_LLAMA, "num_hidden_layers": 3, "hidden_size": 128}, seed=2)
    with pytest.raises(ValueError, match="the prefill program was lowered from another model than the decode"):
        ts.compile(ts.trace(other).lower("prefill"), ts.trace(model).lower("decode"),
                   ts.CompileConfig(num_kv_pages=8))


def test_a_program_given_the_other_modes_metadata_names_what_it_lacks(model):
    """A decode descriptor has no attention tiles nor decoder view: the prefill program
    says so, rather than a KeyError from inside a segment."""
    traced = ts.trace(model)
    decode_meta = refresh_decode([DecodeRow(5, 3, (1,))], 1, 8, PAGE)
    with pytest.raises(TypeError, match=r"prefill program reads attention_tiles, .*\(DecodeMetadata\) lacks: "
                                        r"pass an ExtendMetadata"):
        traced.lower("prefill")(cache(model), decode_meta)
    with pytest.raises(TypeError, match=r"traced model reads input_ids, .*\(NoneType\) lacks"):
        traced(cache(model), None)


def test_traced_and_lowered_reprs_are_one_line(model):
    """At a prompt, ``traced`` printed the whole module tree (398 lines for the default model)."""
    traced = ts.trace(model)
    assert repr(traced) == f"Traced(LlamaForCausalLM, {len(traced.graph_module.graph.nodes)} nodes)"
    assert repr(traced.lower("prefill")) == "Lowered(mode='prefill', narrowed=True)"


def test_tracing_a_traced_graph_says_it_is_traced_already(model):
    """A Traced's graph_module is an fx class named Traced: ``got Traced`` misled."""
    traced = ts.trace(model)
    with pytest.raises(TypeError, match=r"got a Traced, which is traced already"):
        ts.trace(traced)
    with pytest.raises(TypeError, match=r"got a torch.fx.GraphModule \(a Traced's graph_module\?\), which is traced"):
        ts.trace(traced.graph_module)


def test_narrowing_frontier_follows_the_last_cache_write(model):
    stages = ts.trace(model).lower("prefill").stages
    assert list(stages) == ["encoder", "narrowing", "decoder", "finish"]
    written = _layers(stages["encoder"], WRITE_KV_TARGETS)
    decoder_attentions = [n for s in stages["decoder"] for n in s.graph_module.graph.nodes
                          if n.target in ATTENTION_TARGETS]
    c = model.config
    last_writer = c.num_layers - c.num_kv_shared_layers - 1
    assert written == list(range(last_writer + 1)) and not _layers(stages["decoder"], WRITE_KV_TARGETS)
    assert len(decoder_attentions) == c.num_kv_shared_layers + 1  # the last writer's and the shared
    assert all(s.kind == "break" for s in stages["narrowing"] + stages["finish"])


def test_decode_is_one_graph_segment(model):
    lowered = ts.trace(model).lower("decode")
    assert [(s.kind, s.stage) for s in lowered.segments] == [("graph", "decode")]
    broken = ts.trace(model).lower("decode", decode_graph=False)
    assert [s.kind for s in broken.segments].count("break") == model.config.num_layers


def test_decode_heads_read_the_final_norm_without_a_gather(model):
    """Decode samples every row, so the sampled rows' gather is dropped and the final norm
    joins the head's product; prefill keeps the gather (its finish stage samples a few)."""
    decode = ts.trace(model).lower("decode").segments[0].graph_module.graph
    assert not [n for n in decode.nodes if n.target == "index_select"]
    [head] = [n for n in decode.nodes if n.target == OPS.norm_linear.default
              and n.args[2].target == "model.norm.weight"]
    assert head.args[4].target == "lm_head.weight"
    prefill = ts.trace(model).lower("prefill")
    assert any(n.target == "index_select" for s in prefill.segments for n in s.graph_module.graph.nodes)


def test_decode_projections_share_the_split_counters(model):
    """Every decode projection is handed the one zeroed counter buffer (splits reduced in
    their launch); no attention is (its splits merge in a kernel of their own), nor any
    prefill op."""
    decode = ts.trace(model).lower("decode").segments[0].graph_module
    attentions = [n for n in decode.graph.nodes if n.target in ATTENTION_TARGETS]
    projections = [n for n in decode.graph.nodes if n.target in SPLITTING]
    assert len(attentions) == model.config.num_layers and len(projections) == 4 * model.config.num_layers + 1
    assert {n.kwargs["split_counters"].target for n in projections} == {SPLIT_COUNTERS}
    assert not any("split_counters" in n.kwargs for n in attentions)
    counters = getattr(decode, SPLIT_COUNTERS)
    assert counters.dtype == torch.int32 and counters.shape == (SPLIT_COUNTER_SLOTS,) and not counters.any()
    prefill = ts.trace(model).lower("prefill")
    assert not any("split_counters" in n.kwargs for s in prefill.segments for n in s.graph_module.graph.nodes)


def test_history_names_every_pass(model):
    traced = ts.trace(model)
    assert [h.pass_name for h in traced.lower("prefill").history] == \
        ["trace", "narrow_rows", "extend_kernels", "fuse_norms", "fuse_rope_write_kv", "rope_kernels",
         "fuse_latent_write", "fuse_moe_add", "stage_breaks", "split_segments"]
    assert traced.lower("prefill", attention_breaks=True).history[8].pass_name == "attention_breaks"
    assert [name for name, _ in traced.lower("decode").history] == [
        "trace", "decode_kernels", "drop_sample_gather", "recurrent_steps", "fuse_norms", "fuse_rope_write_kv",
        "fuse_rope_decode_attention", "fuse_head_norms", "rope_kernels", "fuse_latent_write",
        "fuse_latent_query_rope", "fuse_latent_write_attention", "fuse_moe_add", "select_linear",
        "fuse_gated_linear", "fuse_shared_experts", "fuse_router", "fuse_norm_route", "fuse_norm_linear",
        "merge_splits_in_launch", "whole_graph", "split_segments"]
    texts = [text for _, text in traced.lower("prefill").history]
    assert "stage=encoder" in texts[1] and "extend_attention" in texts[2] and "rope_write_kv" in texts[4] \
        and "segment=" in texts[8] and "segment 00." in texts[9]


def test_networkx_export_matches_segments(model):
    lowered = ts.trace(model).lower("prefill")
    g = lowered.to_networkx()
    assert list(g.nodes) == [s.name for s in lowered.segments]
    producer = {v: s.name for s in lowered.segments for v in s.outputs}
    expected = {(producer[v], s.name) for s in lowered.segments for v in s.inputs if v in producer}
    assert set(g.edges) == expected
    for a, b, data in g.edges(data=True):
        assert data["values"] and set(data["values"]) <= set(_seg(lowered, b).inputs)


def test_as_text_names_metadata_inputs(model):
    text = ts.trace(model).lower("prefill").as_text()
    for name in ("slot_mapping", "block_tables", "row_request", "view_rows", "view_sample_rows"):
        assert f"%{name}" in text


def test_narrowing_needs_a_sample_gather():
    class NoGather(torch.nn.Module):
        config = random_model(TINY_LLAMA).config

        def forward(self, kv_cache, meta):
            return meta.positions.float()
    with pytest.raises(ValueError, match="sample_rows"):
        ts.trace(NoGather()).lower("prefill")


def _layers(segments, targets):
    """The layers of the ``targets`` ops in ``segments`` (the fused rotary write takes the
    query, the rotary table and the positions before the cache)."""
    layer_arg = {ROPE_WRITE_KV: 6, **dict.fromkeys(WRITE_KV_TARGETS[:2], 3)}
    return sorted({n.args[layer_arg.get(n.target, 2)]
                   for s in segments for n in s.graph_module.graph.nodes if n.target in targets})


def _seg(lowered, name):
    return next(s for s in lowered.segments if s.name == name)


def test_decode_fusions_leave_few_ops_per_layer(model):
    graph = ts.trace(model).lower("decode").segments[0].graph_module.graph
    targets = [str(n.target) for n in graph.nodes if n.op in ("call_function", "call_module")]
    c = model.config
    writers = c.num_layers - c.num_kv_shared_layers
    assert targets.count("tokenspeed.rope_decode_attention.default") == writers
    assert "tokenspeed.rope_write_kv.default" not in targets
    assert targets.count("tokenspeed.decode_attention.default") == c.num_kv_shared_layers
    assert targets.count("tokenspeed.norm_linear.default") == 2 * c.num_layers + 1  # qkv, gate_up; the head
    assert "tokenspeed.add_rms_norm.default" not in targets    # the final norm: in the head's
    assert targets.count("tokenspeed.gated_linear.default") == c.num_layers
    assert "tokenspeed.silu_and_mul.default" not in targets
    assert not any(t.endswith("layernorm") or t == "<built-in function add>" for t in targets)


def test_narrowing_keeps_ungatherable_values_in_the_encoder(monkeypatch):
    """A reshape that folds rows into heads makes a value that is not row-shaped; the op
    reading it back must run over every row rather than read it ungathered."""
    from tokenspeed.models import llama

    def folding_forward(self, h, positions, kv_cache, meta):
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        self._write_kv(k, v, positions, kv_cache, meta)
        q = (q.reshape(-1, self.head_dim) * 1.0).view(-1, self.num_heads, self.head_dim)
        o = llama.ops.attention(self.rotary(q, positions), kv_cache, self.kv_layer,
                                meta.block_tables, meta.row_request, positions, self.scale, self.window)
        return self.o_proj(o.view(-1, self.num_heads * self.head_dim))

    monkeypatch.setattr(llama.Attention, "forward", folding_forward)
    model = random_model(TINY_LLAMA, seed=4)
    traced, meta = ts.trace(model), two_requests(width=2)
    narrowed, _ = run_twice(traced.lower("prefill"), model, meta)
    plain, _ = run_twice(traced.lower("prefill", narrow=False), model, meta)
    torch.testing.assert_close(narrowed, plain, rtol=1e-5, atol=1e-5)


def test_narrowed_prefill_equals_unnarrowed_on_every_kept_row(model):
    """Invariant 7 over the whole decoder view, not only the sampled rows: sample every
    kept row (view_sample_rows = all of the view) and compare with the same token rows."""
    import attrs
    meta = two_requests(width=3)
    live = meta.num_live_view_rows
    every_kept = attrs.evolve(meta, sample_rows=meta.view_rows[:live],
                              view_sample_rows=torch.arange(live))
    traced = ts.trace(model)
    narrowed, _ = run_twice(traced.lower("prefill"), model, every_kept)
    plain, _ = run_twice(traced.lower("prefill", narrow=False), model, every_kept)
    assert narrowed.shape[0] == live == 3 + 1 + 3
    torch.testing.assert_close(narrowed, plain, rtol=1e-5, atol=1e-5)


def test_a_broadcast_add_is_not_fused_into_the_norm(monkeypatch):
    from tokenspeed.models import llama
    plain = llama.LlamaModel.forward

    def with_bias(self, kv_cache, meta):
        h = plain(self, kv_cache, meta)
        return self.norm(h + self.norm.weight)  # [rows, hidden] + [hidden]: a broadcast

    monkeypatch.setattr(llama.LlamaModel, "forward", with_bias)
    graph = ts.trace(random_model(TINY_LLAMA)).lower("decode").segments[0].graph_module.graph
    [head] = [n for n in graph.nodes if n.target == OPS.norm_linear.default and n.args[2].target == "model.norm.weight"
              and n.args[4].target == "lm_head.weight"]
    assert head.args[1] is None and head.args[0].target == operator.add   # the add stays its own op


def test_shape_propagation_leaves_every_weight_where_it_was():
    """``fake_values`` swaps the weights for meta copies and puts them back, also when one
    module is reachable by two names (restored in the wrong order, it kept a meta copy)."""
    from torch import fx
    from tokenspeed.ir.rows import fake_values

    graph = fx.Graph()
    x = graph.call_method("expand", (graph.call_function(torch.unsqueeze, (
        graph.call_method("float", (graph.placeholder("input_ids"),)), 1)), -1, 2))
    graph.output(graph.call_function(torch.add, (graph.call_module("a", (x,)), graph.call_module("b", (x,)))))
    shared = torch.nn.Linear(2, 2)
    gm = fx.GraphModule({"a": shared, "b": shared}, graph)
    assert gm.a is gm.b
    before = dict(gm.named_parameters(remove_duplicate=False))
    values = fake_values(gm, random_model(TINY_LLAMA).config, 5)
    assert values["add"].shape == (5, 2) and values["add"].device.type == "meta"
    after = dict(gm.named_parameters(remove_duplicate=False))
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
