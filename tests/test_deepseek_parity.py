"""DeepSeek-V2/V3 (latent attention) against transformers: greedy token identity under
chunked prefill across chunk boundaries, graphs and eager, prefix caching, preemption;
and the latent cache's bytes per token. The ``*_moe`` variants need ``tokenspeed::moe``."""

import shutil

import pytest
import torch

import tokenspeed as ts
from tokenspeed.backends.mla import MlaAttentionBackend
from tokenspeed.backends.paged import PagedAttentionBackend
from tokenspeed.backends.pool_geometry import PoolGeometry
from tokenspeed.engine.speculative import PerRequestDrafts
from tokenspeed.models.errors import ModelFileError
from tokenspeed.models.loader import load
from tokenspeed.scheduling.prompt_limits import most_pages_held

from deepseek_models import LAYERS, VARIANTS, checkpoint, hf_config, hf_model, reference
from hf_models import edit_config, make_prompts, new_tmpdir
from test_hf_parity import Recorder

MAX_TOKENS = 10
LENGTHS = (1, 5, 70, 33)          # 70 spans three chunks of 32, 33 ends one past a chunk
PROMPTS = make_prompts(LENGTHS, seed=11)
GREEDY = ts.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
DENSE = sorted(v for v in VARIANTS if v.endswith("_dense"))
MOE = sorted(v for v in VARIANTS if v.endswith("_moe"))


def tokens(outputs):
    return [o.token_ids for o in outputs]


def expected(variant, prompts=PROMPTS):
    return [tuple(r) for r in reference(variant, prompts, MAX_TOKENS)]


def chunked_engine(variant, **kw):
    """Chunks of at most 32 tokens (the 70-token prompt spans three), three sequences at once."""
    return ts.LLM(checkpoint(variant), **{"page_size": 4, "max_num_seqs": 3, "max_num_batched_tokens": 32, **kw})


@pytest.mark.slow
@pytest.mark.parametrize("variant, graphs", [(v, False) for v in DENSE] + [("v2_dense", True), ("v3_dense", True)],
                         ids=lambda x: {False: "eager", True: "graphs"}.get(x, x))
def test_chunked_prefill_matches_transformers(variant, graphs):
    """``graphs``: the CPU stand-in's captured segments (decode with the absorbed form inside)."""
    llm = chunked_engine(variant, graphs=graphs)
    assert bool(llm.compiled.decode.graphs) == graphs
    recorder = Recorder(llm)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(variant)
    assert any(start > 0 for batch in recorder.extend_batches for n, start, _ in batch if n > 1), \
        "the 70-token prompt was never chunked"
    assert all(sum(n for n, _, _ in batch) <= 32 for batch in recorder.extend_batches)


@pytest.mark.parametrize("variant", MOE)
def test_mixture_layers_match_transformers(variant):
    llm = chunked_engine(variant)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected(variant)


@pytest.mark.parametrize("variant", ["v2_dense", "v3_dense"])
def test_a_cached_prefix_changes_no_token(variant):
    system = make_prompts((21,), seed=31)[0]            # five full pages of 4, and a bit
    prompts = [system + tail for tail in make_prompts((3, 9, 1), seed=32)]
    llm = ts.LLM(checkpoint(variant), page_size=4, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert tokens(first + rest) == expected(variant, prompts)
    assert all(o.metrics.num_cached_tokens == 20 for o in rest)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["v2_dense", "v3_dense"])
def test_preempted_requests_recompute_their_latents(variant, monkeypatch):
    """More requests than the pool holds at full length: some are preempted mid-generation."""
    prompts = make_prompts((1, 5, 40, 70, 32, 33), seed=11)
    longest = 70 + MAX_TOKENS
    num_kv_pages = most_pages_held(longest, 4) + 1
    llm = ts.LLM(checkpoint(variant), page_size=4, num_kv_pages=num_kv_pages, max_num_seqs=6,
                 max_num_batched_tokens=64)
    scheduler, preempted = llm.engine.scheduler, []
    original = scheduler._preempt
    monkeypatch.setattr(scheduler, "_preempt", lambda r: (preempted.append(len(r.output)), original(r))[1])
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == expected(variant, prompts)
    assert any(n > 0 for n in preempted), f"no request was preempted mid-generation: {preempted}"
    assert scheduler.allocator.num_free == num_kv_pages - 1


def test_the_cache_holds_a_latent_and_a_rope_key_per_token_and_layer():
    """kv_lora_rank + qk_rope_head_dim values, no heads, for every layer: (32 + 16) * 3 * 4
    bytes in float32, against 2 * heads * (nope + rope) per layer for multi-head keys and values."""
    llm = ts.LLM(checkpoint("v3_dense"), page_size=4)
    c = hf_config("v3_dense")
    per_token = LAYERS * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert llm.compiled.pool.page_bytes == 4 * per_token == 4 * 576
    assert tuple(llm.compiled.kv_cache.shape[-2:]) == (1, 48) and llm.compiled.kv_cache.shape[1] == 1
    multi_head = LAYERS * 2 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim) * 4
    assert multi_head == per_token * 16 // 3


def test_decode_attends_the_latents_in_the_absorbed_form_and_prefill_expands_them():
    traced = ts.LLM(checkpoint("v2_dense"), page_size=4).traced
    decode, prefill = traced.lower("decode").as_text(), traced.lower("prefill").as_text()
    # decode's cache write joins its attention (``fuse_latent_write_attention``)
    assert decode.count("tokenspeed.mla_write_decode_attention") == LAYERS
    assert "tokenspeed.mla_attention." not in decode and "tokenspeed.mla_decode_attention" not in decode
    assert prefill.count("tokenspeed.mla_attention") == LAYERS and "mla_decode_attention" not in prefill
    fused = "tokenspeed.norm_rope_write_latent"   # the latent's norm, the key's rotary and the write
    assert prefill.count(fused) == LAYERS and fused not in decode
    # the query's and the latent's projections stacked: one product, the input norm folded in
    assert decode.count("q_kv_a_proj_normed = tokenspeed.norm_linear") == LAYERS
    # decode's attention rotates its query's rope part itself; prefill keeps the rope op
    assert decode.count(", True, %kv_cache, ") == LAYERS and "tokenspeed.rope(" not in decode
    assert prefill.count("tokenspeed.rope(") == LAYERS


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_each_mixture_layer_adds_its_shared_experts_inside_the_moe_op(mode):
    """``routed + shared_experts(x)`` is one op (``fuse_moe_add``); the dense first layer has no mixture."""
    lowered = ts.LLM(checkpoint("v2_moe"), page_size=4).traced.lower(mode)
    nodes = [n for seg in lowered.segments for n in seg.graph_module.graph.nodes]
    mixtures = [n for n in nodes if n.op == "call_function" and "tokenspeed.moe" in str(n.target)]
    if mode == "decode":   # decode's mixture runs the shared experts' MLP itself (``fuse_shared_experts``)
        assert all(len(n.args) == 5 and set(n.kwargs) == {"shared_w13", "shared_w2"} for n in mixtures)
        assert not [n for n in nodes if "shared_experts" in n.name and n.op == "call_function"]
    else:
        assert all(len(n.args) == 6 for n in mixtures)
    assert len(mixtures) == LAYERS - 1
    assert not [u for n in mixtures for u in n.users if "add" in str(u.target) and "rms_norm" not in str(u.target)]


@pytest.mark.parametrize("variant", MOE)
def test_experts_stored_one_by_one_load_into_the_stacked_weights(variant):
    """transformers saves each routed expert's matrices apart; tokenspeed::moe reads them
    stacked (as transformers 5 holds them in memory). The loading is the mixtures' own
    (``models.moe_checkpoint``, with the op on branch i34moe)."""
    ours, theirs = load(checkpoint(variant)).model, hf_model(variant)[0].model
    for layer in range(1, LAYERS):
        for ours_name, name in (("w13", "gate_up_proj"), ("w2", "down_proj")):
            assert torch.equal(getattr(ours.layers[layer].mlp.experts, ours_name),
                               getattr(theirs.layers[layer].mlp.experts, name)), (layer, name)
        assert torch.equal(ours.layers[layer].mlp.gate.weight, theirs.layers[layer].mlp.gate.weight)


def test_the_mla_leaf_serves_latent_caches_and_captures_prefill_attention_in_its_graphs():
    compiled = ts.LLM(checkpoint("v2_dense"), page_size=4).compiled
    assert isinstance(compiled.binding.backend, MlaAttentionBackend)
    support = compiled.binding.backend.graph_support()
    assert support.prefill_attention and support.decode_graph
    segments = compiled.binding.lowered["prefill"].segments
    assert [s.name for s in segments if s.kind == "break"] == ["01.narrowing.break", "03.finish.break"]


def test_a_float8_latent_cache_is_refused_by_the_mla_leaf():
    with pytest.raises(ValueError, match="an MLA cache cannot be float8"):
        ts.LLM(checkpoint("v2_dense"), page_size=4, kv_cache_dtype="fp8")


class TruthDrafts(PerRequestDrafts):
    """Drafts of plain decoding's next three tokens, the last one wrong every other call:
    windows kept whole and in part."""

    def __init__(self, truth: list[list[int]]):
        self.truth, self.calls = truth, 0

    def propose(self, tokens, limit: int) -> tuple[int, ...]:
        self.calls += 1
        full = next(t for t in self.truth if t[:len(tokens)] == list(tokens))
        drafts = list(full[len(tokens):len(tokens) + min(3, limit)])
        if drafts and self.calls % 2:
            drafts[-1] = 3 + (drafts[-1] + 1) % 300
        return tuple(drafts)


def test_speculative_windows_give_plain_decodings_tokens():
    """Verify windows: several rows of one request attend the latents in the absorbed
    form, each up to its own position, after all of them are written."""
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], make_prompts((23,), seed=5)[0]]
    kw = dict(page_size=4, max_num_seqs=4)
    plain = ts.LLM(checkpoint("v3_dense"), **kw)
    speculative = ts.LLM(checkpoint("v3_dense"), speculative=ts.SpeculativeConfig(num_tokens=3, verify_cost=1.0), **kw)
    params = ts.SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = tokens(plain.generate(prompts, params, use_tqdm=False))
    speculative.engine.drafter = TruthDrafts([p + list(w) for p, w in zip(prompts, want)])
    got = speculative.generate(prompts, params, use_tqdm=False)
    assert tokens(got) == want
    assert all(o.metrics.mean_accept_length > 2 for o in got)


def test_a_projection_of_another_shape_names_the_latent_fields_that_set_it():
    """A kv_lora_rank edited by hand: the loader's error says which fields set kv_b_proj's columns."""
    path = new_tmpdir("ts_ds_edited_")
    shutil.copytree(checkpoint("v2_dense"), path, dirs_exist_ok=True)
    edit_config(path, kv_lora_rank=40)
    with pytest.raises(ModelFileError, match=r"kv_a_layernorm.weight: checkpoint shape \(32,\), model expects "
                                             r"\(40,\) \(rows: kv_lora_rank=40\)"):
        load(path)


def test_a_pool_of_the_other_layout_is_refused_before_anything_is_built():
    latent = PoolGeometry(3, 4, 1, 48, torch.float32, "cpu", parts=1)
    MlaAttentionBackend().check_pool(latent, torch.zeros(latent.shape(5)))
    with pytest.raises(ValueError, match=r"parts 2 \(expected 1\)"):
        MlaAttentionBackend().check_pool(latent, torch.zeros(3, 2, 5, 4, 1, 48))
    keys_values = PoolGeometry(3, 4, 2, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="the MLA backend reads one latent row per token"):
        MlaAttentionBackend().check_pool(keys_values, torch.zeros(keys_values.shape(5)))
    with pytest.raises(ValueError, match=r"parts 1 \(expected 2\)"):
        PagedAttentionBackend().check_pool(keys_values, torch.zeros(3, 1, 5, 4, 2, 16))


def test_fp8_quantization_of_latent_attention_is_refused():
    with pytest.raises(ValueError, match="quantization='fp8'.*latent attention"):
        ts.LLM(checkpoint("v2_dense"), quantization="fp8")


def test_a_cast_keeps_the_routers_float32_gate():
    """``ts.LLM`` casts a loaded model to its dtype: the gate must keep its float32 values."""
    model = load(checkpoint("v3_moe"), dtype=torch.float32)
    gates = {n: p for n, p in model.named_parameters() if ".gate." in n or n.endswith("e_score_correction_bias")}
    assert gates
    kept = {n: p.detach().clone() for n, p in gates.items()}
    model.to(dtype=torch.bfloat16)
    after = dict(model.named_parameters())
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], kept[n]) for n in kept)


@pytest.mark.parametrize("weight_format", [None, "Q8_0"], ids=["dense", "block"])
def test_only_dense_shared_experts_join_the_mixture(weight_format):
    """A projection naming its weight's format (GGUF blocks, FP8) stays its own op: the
    mixture's pair kernels read 16-bit weights."""
    from torch import fx
    from tokenspeed.ir.ops import MOE, OPS
    from tokenspeed.ir.program import Program
    from tokenspeed.passes.shared_experts import fuse_shared_experts
    graph = fx.Graph()
    x, w13, w2, weights, ids, s13, s2 = (graph.placeholder(n) for n in ("x", "w13", "w2", "wt", "ids", "s13", "s2"))
    fmt = () if weight_format is None else (weight_format,)
    gate_up = graph.call_function(OPS.linear.default, (x, s13, None, *fmt))
    down = graph.call_function(OPS.gated_linear.default, (gate_up, s2, None, *fmt))
    graph.output(graph.call_function(MOE, (x, w13, w2, weights, ids, down)))
    lowered = fuse_shared_experts(Program(mode="decode", graph_module=fx.GraphModule(torch.nn.Module(), graph)))
    nodes = list(lowered.graph_module.graph.nodes)
    moe = next(n for n in nodes if n.target == MOE)
    linears = [n.name for n in nodes if n.target in (OPS.linear.default, OPS.gated_linear.default)]
    if weight_format is None:
        assert {k: v.name for k, v in moe.kwargs.items()} == {"shared_w13": "s13", "shared_w2": "s2"}
        assert len(moe.args) == 5 and not linears
    else:
        assert moe.args[5].name == down.name and not moe.kwargs and linears == [gate_up.name, down.name]
