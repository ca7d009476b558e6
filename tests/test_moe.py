"""Mixtures of experts (Mixtral, Qwen3-MoE): the ``moe`` op against a dense per-token loop,
the config's sparse layers and refusals, expert tensors at load, and the op in the IR.

Greedy token identity with transformers runs in tests/test_hf_parity.py (the ``mixtral``
and ``qwen3_moe`` variants); the Triton kernel in tests/test_moe_kernel.py.
"""

import json

import gguf
import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file, save_file

import tokenspeed as ts
from tokenspeed import stages
from tokenspeed.backends.kernels.moe_reference import expert_mlp
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.gguf_writer import metadata, write
from tokenspeed.models.llama import MLP
from tokenspeed.models.moe import SparseMoeBlock
from tokenspeed.models.random import hf_state_dict, random_model

from hf_models import checkpoint, copy_checkpoint, edit_config, hf_model, make_prompts, new_tmpdir, reference

FEW = settings(max_examples=25, deadline=None, derandomize=True)
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 128, "hidden_size": 32,
             "intermediate_size": 48, "moe_intermediate_size": 24, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4,
             "num_experts_per_tok": 2, "max_position_embeddings": 128, "dtype": "float32"}


def dense_moe(x, w13, w2, weights, ids):
    """The definition, one token and one of its k choices at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            out[t] += weights[t, j] * expert_mlp(x[t:t + 1], w13[e], w2[e])[0]
    return out


def routed(tokens, experts, k, hidden, inter, seed):
    """Random activations, experts and a softmax top-k routing of them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    weights, ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(k)
    return x, w13, w2, weights, ids


@st.composite
def moe_cases(draw):
    experts = draw(st.integers(1, 8))
    return (draw(st.integers(1, 12)), experts, draw(st.integers(1, experts)), draw(st.integers(1, 24)),
            draw(st.integers(1, 20)), draw(st.integers(0, 2 ** 16)))


@FEW
@given(moe_cases(), st.sampled_from([torch.int32, torch.int64]))
def test_each_token_gets_its_top_k_experts_once_with_the_routers_weights(case, id_dtype):
    x, w13, w2, weights, ids = routed(*case)
    out = torch.ops.tokenspeed.moe(x, w13, w2, weights, ids.to(id_dtype))
    torch.testing.assert_close(out, dense_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@FEW
@given(moe_cases(), st.integers(1, 9))
def test_padding_rows_never_reach_a_real_rows_output(case, padding):
    x, w13, w2, weights, ids = routed(*case)
    pad = routed(padding, *case[1:5], seed=case[5] + 1)
    padded = [torch.cat([a, 1e3 * b if a is x else b]) for a, b in zip((x, weights, ids), (pad[0], pad[3], pad[4]))]
    out = torch.ops.tokenspeed.moe(padded[0], w13, w2, padded[1], padded[2])
    torch.testing.assert_close(out[:len(x)], torch.ops.tokenspeed.moe(x, w13, w2, weights, ids),
                               rtol=1e-6, atol=1e-6)


def test_a_weight_of_zero_drops_the_expert():
    x, w13, w2, weights, ids = routed(5, 4, 2, 16, 8, seed=3)
    weights[:, 1] = 0
    alone = torch.ops.tokenspeed.moe(x, w13, w2, weights[:, :1], ids[:, :1])
    torch.testing.assert_close(torch.ops.tokenspeed.moe(x, w13, w2, weights, ids), alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_a_cached_prefix_gives_transformers_tokens(variant):
    """The second request's shared 41 tokens come from the cache (over several pages and
    chunks), and its experts run on the rest alone."""
    system = make_prompts((41,), seed=5)[0]
    prompts = [system + [11, 12, 13], system + [21, 22, 23, 24, 25]]
    llm = ts.LLM(checkpoint(variant), page_size=4, max_num_batched_tokens=16)
    params = ts.SamplingParams(temperature=0, max_tokens=8)
    outs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    assert [o.token_ids for o in outs] == reference(variant, prompts, 8)
    assert outs[1].metrics.num_cached_tokens >= 40


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("fields, sparse", [
    ({}, (0, 1, 2, 3)), ({"mlp_only_layers": [0, 2]}, (1, 3)), ({"decoder_sparse_step": 2}, (1, 3)),
    ({"decoder_sparse_step": 2, "mlp_only_layers": [3]}, (1,)),
])
def test_qwen3_moe_sparse_layers_follow_transformers(fields, sparse):
    config = ModelConfig.from_hf({**QWEN3_MOE, **fields})
    assert config.moe.sparse_layers == sparse and config.qk_norm
    model = random_model({**QWEN3_MOE, **fields})
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock if i in sparse else MLP for i in range(4)]


def test_moe_settings_are_read():
    moe = ModelConfig.from_hf({**QWEN3_MOE, "norm_topk_prob": True}).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.normalize_top_k) == (4, 2, 24, True)
    assert not ModelConfig.from_hf(QWEN3_MOE).moe.normalize_top_k
    mixtral = ts.models.load(checkpoint("mixtral")).config.moe
    assert (mixtral.num_experts, mixtral.intermediate_size, mixtral.normalize_top_k) == (4, 48, True)
    assert ModelConfig.from_hf({**QWEN3_MOE, "num_experts": 0}).moe is None   # dense, as transformers


def test_sliding_windows_bind_every_layer_as_transformers_reads_them():
    mixtral = json.loads((checkpoint("mixtral") / "config.json").read_text())
    assert ModelConfig.from_hf({**mixtral, "sliding_window": 16}).layer_windows == (16, 16)
    qwen = {**QWEN3_MOE, "sliding_window": 16, "max_window_layers": 2, "layer_types": ["full_attention"] * 4}
    assert ModelConfig.from_hf(qwen).layer_windows == ()
    assert ModelConfig.from_hf({**qwen, "use_sliding_window": True}).layer_windows == (16,) * 4


@pytest.mark.parametrize("fields, fragments", [
    ({"num_experts_per_tok": 5}, ("num_experts_per_tok=5", "4")),
    ({"mlp_only_layers": [4]}, ("mlp_only_layers=[4]", "[0, 4)")),
    ({"decoder_sparse_step": 0}, ("decoder_sparse_step=0",)),
    ({"norm_topk_prob": "yes"}, ("norm_topk_prob='yes'",)),
    ({"moe_intermediate_size": None}, ("moe_intermediate_size",)),
    ({"num_experts_per_tok": None}, ("num_experts_per_tok",)),
    ({"quantization_config": {"quant_method": "fp8"}}, ("quantization_config", "Qwen3MoeForCausalLM")),
])
def test_moe_fields_it_cannot_honour_are_named(fields, fragments):
    with pytest.raises(ValueError) as error:
        ModelConfig.from_hf({k: v for k, v in {**QWEN3_MOE, **fields}.items() if v is not None})
    assert all(f in str(error.value) for f in fragments), str(error.value)


def test_fp8_quantization_of_a_mixture_of_experts_is_refused():
    with pytest.raises(ValueError, match="quantization='fp8'.*MixtralForCausalLM's experts"):
        ts.LLM(checkpoint("mixtral"), quantization="fp8")


def test_gguf_mixture_of_experts_is_refused():
    meta = {**metadata(2, 64, 128, 4, 2, 16, 64), "expert_count": (8, gguf.GGUFValueType.UINT32)}
    path = write(new_tmpdir("ts_gguf_moe_") / "m.gguf", "llama", meta, {})
    with pytest.raises(ValueError, match="llama.expert_count=8: a mixture of experts"):
        ts.models.load(path)
    with pytest.raises(ValueError, match="'qwen3moe' .GGUF mixtures of experts are not read"):
        ts.models.load(write(new_tmpdir("ts_gguf_moe_") / "q.gguf", "qwen3moe", meta, {}))


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("variant, name", [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w3.weight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w2.weight"),
    ("mixtral", "model.layers.1.block_sparse_moe.gate.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.7.gate_proj.weight"),
    ("qwen3_moe", "model.layers.0.mlp.experts.2.down_proj.weight"),
])
def test_missing_expert_is_named_as_stored(variant, name):
    path = copy_checkpoint(variant)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors \[.*" + name.replace(".", r"\.")):
        ts.models.load(path)


def test_expert_of_the_wrong_width_names_the_field():
    path = copy_checkpoint("qwen3_moe")
    edit_config(path, moe_intermediate_size=32)
    with pytest.raises(ValueError, match=r"experts\.0\.\w+\.weight.*moe_intermediate_size=32"):
        ts.models.load(path)


def test_experts_load_into_their_slices():
    """Each stored matrix lands in its expert's slice of w13 / w2, and back (``hf_state_dict``)."""
    path = checkpoint("qwen3_moe")
    stored = load_file(str(next(path.glob("*.safetensors"))))
    experts = ts.models.load(path).model.layers[0].mlp.experts
    assert torch.equal(experts.w13[5, :40], stored["model.layers.0.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(experts.w13[5, 40:], stored["model.layers.0.mlp.experts.5.up_proj.weight"])
    assert torch.equal(experts.w2[6], stored["model.layers.0.mlp.experts.6.down_proj.weight"])
    state = hf_state_dict(ts.models.load(path))
    assert state.keys() == stored.keys() and all(torch.equal(state[n], stored[n]) for n in stored)


def test_mixtral_round_trips_through_hf_names():
    config = json.loads((checkpoint("mixtral") / "config.json").read_text())
    model = random_model(config, seed=1)
    state = hf_state_dict(model)
    assert "model.layers.1.block_sparse_moe.experts.2.w1.weight" in state
    again = ts.models.loader.build(model.config)
    ts.models.loader.load_state_dict(again, state)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("variant", ["mixtral", "qwen3_moe"])
def test_transformers_own_state_dict_loads(variant):
    """transformers 5 holds each layer's experts fused (``experts.gate_up_proj``, ``down_proj``)."""
    hf = hf_model(variant)[0]
    assert any(n.endswith("experts.gate_up_proj") for n in hf.state_dict())
    ours = ts.models.loader.build(ts.models.load(checkpoint(variant)).config)
    ts.models.loader.load_state_dict(ours, hf.state_dict())
    stored = ts.models.load(checkpoint(variant))
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), stored.state_dict().values()))


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_the_ir_shows_the_moe_op(mode):
    text = stages.trace(ts.models.load(checkpoint("qwen3_moe"))).lower(mode).as_text()
    assert text.count("tokenspeed.moe(") == 1      # layer 0 sparse, layer 1 dense (mlp_only_layers)
    assert "%layer0_moe = tokenspeed.moe(%layer0_post_attention_layernorm, %layer0_experts_w13, " \
           "%layer0_experts_w2, %layer0_topk_weights, %layer0_topk_ids)" in text


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_decode_routes_with_one_op_and_prefill_with_the_gate_and_the_choice(mode):
    """``fuse_router`` (decode and verify): the gate's product and ``softmax_top_k`` become
    one ``route`` op, and ``fuse_norm_route`` puts the norm before it in the same op, whose
    normed rows the mixture reads and whose sum the next layer does; prefill keeps them."""
    text = stages.trace(ts.models.load(checkpoint("qwen3_moe"))).lower(mode).as_text()
    fused = ("%model_layers_0_mlp_gate_route_normed = tokenspeed.norm_route(%embed_tokens, %layer0_o_proj, "
             "%layer0_post_attention_layernorm_weight, 1e-06, %model_layers_0_mlp_gate_weight, 2, True, 1.0, "
             "split_counters=%split_counters)")
    assert (fused in text, "softmax_top_k(" in text) == ((True, False) if mode == "decode" else (False, True))
    if mode == "decode":
        assert "%layer0_post_attention_layernorm = getitem(%model_layers_0_mlp_gate_route_normed, 2)" in text
        assert "tokenspeed.norm_linear(%add, %layer0_moe, " in text and "tokenspeed.route(" not in text
        assert "add_rms_norm(" not in text   # the final norm is the head's (``drop_sample_gather``)


def test_the_router_pass_takes_the_gates_it_can_and_leaves_the_rest():
    """A 16-bit gate (``linear``), DeepSeek's float32 gate (a cast input and weight); not a
    gate with a bias, nor logits read by anything else."""
    from torch import fx
    from tokenspeed.ir.ops import OPS, ROUTE, SOFTMAX_TOP_K
    from tokenspeed.ir.program import Program
    from tokenspeed.passes.router import fuse_router
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_parameter("gate", torch.nn.Parameter(torch.zeros(4, 8)))
    graph = gm.graph
    x, w, b = (graph.placeholder(n) for n in ("x", "w", "b"))
    gate = graph.get_attr("gate")
    logits = [graph.call_function(OPS.linear.default, (x, w, None)),
              graph.call_function(torch.nn.functional.linear, (graph.call_method("float", (x,)),
                                                               graph.call_method("float", (gate,)))),
              graph.call_function(OPS.linear.default, (x, w, b)),
              graph.call_function(OPS.linear.default, (x, w, None))]
    choices = [graph.call_function(SOFTMAX_TOP_K, (lg, 2, True, 1.0)) for lg in logits]
    graph.output([*choices, logits[3]])
    gm.recompile()
    nodes = list(fuse_router(Program(mode="decode", graph_module=gm)).graph_module.graph.nodes)
    routes = [n for n in nodes if n.target == ROUTE]
    assert [([a.name for a in n.args[:2]], n.kwargs) for n in routes] == \
        [(["x", "w"], {}), (["x", "gate"], {"logits_dtype": torch.float32})]
    assert sum(n.target == SOFTMAX_TOP_K for n in nodes) == 2
    assert not any(n.op == "call_method" or n.target is torch.nn.functional.linear for n in nodes)


def test_the_norm_pass_takes_a_norm_the_router_reads_first():
    """``fuse_norm_route``: a norm (with or without its residual add) read by a ``route`` and
    after it joins the route; one whose normed value or sum is read before the route stays."""
    import operator
    from torch import fx
    from tokenspeed.ir.ops import NORM_ROUTE, OPS, ROUTE
    from tokenspeed.ir.program import Program
    from tokenspeed.passes.fusion import fuse_norm_route
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    graph = gm.graph
    x, res, nw, w = (graph.placeholder(n) for n in ("x", "res", "nw", "w"))
    added = graph.call_function(OPS.add_rms_norm.default, (x, res, nw, 1e-6))
    normed, total = (graph.call_function(operator.getitem, (added, i)) for i in (0, 1))
    first = graph.call_function(ROUTE, (normed, w, 2, True, 1.0))
    mixture = graph.call_function(OPS.moe.default, (normed, w, w, graph.call_function(operator.getitem, (first, 0)),
                                                    graph.call_function(operator.getitem, (first, 1))))
    plain = graph.call_function(OPS.rms_norm.default, (mixture, nw, 1e-6))
    second = graph.call_function(ROUTE, (plain, w, 2, True, 1.0))
    early = graph.call_function(OPS.rms_norm.default, (total, nw, 1e-6))
    read_before = graph.call_function(torch.neg, (early,))
    third = graph.call_function(ROUTE, (early, w, 2, True, 1.0))
    summed = graph.call_function(OPS.add_rms_norm.default, (x, read_before, nw, 1e-6))
    sum_normed, sum_total = (graph.call_function(operator.getitem, (summed, i)) for i in (0, 1))
    sum_read_before = graph.call_function(torch.neg, (sum_total,))
    fourth = graph.call_function(ROUTE, (sum_normed, w, 2, True, 1.0))
    graph.output([second, third, read_before, total, plain, fourth, sum_read_before])
    gm.recompile()
    nodes = list(fuse_norm_route(Program(mode="decode", graph_module=gm)).graph_module.graph.nodes)
    fused = [n for n in nodes if n.target == NORM_ROUTE]
    assert [[getattr(a, "name", a) for a in n.args[:4]] for n in fused] == [["x", "res", "nw", 1e-6],
                                                                              ["moe_default", None, "nw", 1e-6]]
    assert sum(n.target == ROUTE for n in nodes) == 2 and sum(n.target == OPS.add_rms_norm.default for n in nodes) == 1
    moe = next(n for n in nodes if n.target == OPS.moe.default)
    assert moe.args[0].target is operator.getitem and moe.args[0].args == (fused[0], 2)
    outputs = nodes[-1].args[0]
    assert outputs[3].args == (fused[0], 3) and outputs[4].args == (fused[1], 2)
