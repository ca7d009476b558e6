"""Weight-only integers on the CPU (``quantization="int4"``: int4 layers, an int8 head):
the quantizers, torch's CPU kernels against their references, the layers through a model
cast, and the engine.

The kernels compute in bfloat16, so against the float reference of the same integer
weights they are within bfloat16's rounding; a model quantized at load gives the tokens of
the dense model holding those dequantized weights (decisive models), and its logits stay
within ``LOGIT_TOLERANCE`` of the original float model's.
"""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tokenspeed as ts
from tokenspeed.api.llm_arguments import checked_quantization
from tokenspeed.backends.kernels import cpu_int4, cpu_int8
from tokenspeed.ir.integer_weights import pack_int4, quantize_int4, quantize_int8
from tokenspeed.ir import ops
from tokenspeed.ir.weights import INT4, INT8
from tokenspeed.models.weight_only import Int4Linear, Int8Linear, quantized_to_int4
from tokenspeed.models.random import TINY_LLAMA, random_model

from margins import decisive_model, greedy_margins
from test_fp8_models import CONFIG, generate, prefill_logits

# int4 logits against float logits, relative to the float logits' spread (std): the root
# mean square and the largest difference. A weight's error is at most half a step, its
# group's range / 15 (about 8 % of a random weight's spread, twice FP8's); seen on these
# models over seeds 4-7: 0.12-0.15 and 0.38-0.48.
LOGIT_TOLERANCE = {"rms": 0.2, "max": 0.6}


def int4_layers(model) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, Int4Linear)]


def bound(want: torch.Tensor, bias) -> float:
    """1 % of the output and bfloat16's rounding of the product before the bias is added
    (2**-8 of its size): an output the bias nearly cancels keeps the product's rounding
    error (a seed of 0.2332 = 1.8 of product + bias failed a bound of 1 % of the output)."""
    product = want if bias is None else want - bias.float()
    return 1e-2 * float(want.abs().max()) + 2 ** -8 * float(product.abs().max()) + 1e-3


@settings(max_examples=25, deadline=None)
@given(n_tiles=st.integers(1, 4), groups=st.integers(1, 4), seed=st.integers(0, 2**16),
       spread=st.sampled_from([1e-3, 1.0, 50.0]))
def test_quantize_keeps_each_weight_within_half_a_step(n_tiles, groups, seed, spread):
    n, k = 16 * n_tiles, 32 * groups
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * spread
    lone = (0.01, -0.003, 0.0, 1.3)   # groups of one value
    for row, value in enumerate(lone[:n]):
        w[row, :32] = value
    q, scales_zeros = quantize_int4(w)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert scales_zeros.shape == (groups, n, 2) and scales_zeros.dtype == torch.bfloat16
    scale, zero = (t.float().t().repeat_interleave(32, 1) for t in scales_zeros.unbind(-1))
    error = (cpu_int4.dequantize(q, scales_zeros) - w).abs()
    assert (error <= 0.5 * scale * 1.05 + zero.abs() / 256 + 1e-6).all()
    for row, value in enumerate(lone[:n]):
        assert float(error[row, :32].max()) <= abs(value) / 256


DTYPES = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 17), n_tiles=st.integers(1, 3), groups=st.integers(1, 5),
       bias=st.booleans(), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_kernel_matches_the_float_product_of_its_weights(rows, n_tiles, groups, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    n, k = 16 * n_tiles, 32 * groups
    q, scales_zeros = quantize_int4(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, 2 * k, generator=gen).to(dtype)[:, ::2]   # rows with a stride
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = cpu_int4.linear(x, pack_int4(q), scales_zeros, b)
    want = torch.nn.functional.linear(x.bfloat16().float(), cpu_int4.dequantize(q, scales_zeros),
                                      None if b is None else b.float())
    assert out.dtype == dtype and out.shape == (rows, n)
    assert (out.float() - want).abs().max() <= bound(want, b)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 17), n=st.integers(1, 40), k_steps=st.integers(1, 6), bias=st.booleans(),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_int8_kernel_matches_the_float_product_of_its_weights(rows, n, k_steps, bias, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, 16 * k_steps, generator=gen)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and int(q.abs().max()) <= 127
    assert ((cpu_int8.dequantize(q, scale) - w).abs() <= 0.5 * scale.float()[:, None] + 1e-6).all()
    x = torch.randn(rows, 16 * k_steps, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = cpu_int8.linear(x, q, scale, b)
    want = torch.nn.functional.linear(x.bfloat16().float(), cpu_int8.dequantize(q, scale),
                                      None if b is None else b.float())
    assert out.dtype == dtype
    assert (out.float() - want).abs().max() <= bound(want, b)


def test_the_op_runs_the_kernel_on_three_dimensional_rows():
    q, scales_zeros = quantize_int4(torch.randn(32, 64))
    x = torch.randn(2, 3, 64)
    out = ops.linear(x, pack_int4(q), None, INT4, scales_zeros)
    assert out.shape == (2, 3, 32)
    assert torch.equal(out, cpu_int4.linear(x.reshape(6, 64), pack_int4(q), scales_zeros, None).view(2, 3, 32))


def test_shapes_that_do_not_pack_are_refused_by_the_quantizer():
    with pytest.raises(ValueError, match=r"K a multiple of 32 and N of 16; got \[N=16, K=40\]"):
        quantize_int4(torch.randn(16, 40))
    with pytest.raises(ValueError, match=r"got \[N=24, K=32\]"):
        quantize_int4(torch.randn(24, 32))
    with pytest.raises(ValueError, match=r"int8 weight needs K a multiple of 16; got \[N=3, K=40\]"):
        quantize_int8(torch.randn(3, 40))


def test_weight_only_layers_keep_their_dtypes_through_a_model_cast():
    gen = torch.Generator().manual_seed(0)
    dense, x = torch.nn.Linear(64, 32, bias=True), torch.randn(3, 64, generator=gen)
    layer = Int4Linear.quantized(dense).to(torch.float16)
    assert (layer.weight.dtype, layer.weight_scale.dtype, layer.bias.dtype) == \
        (torch.uint8, torch.bfloat16, torch.float16)
    layer = layer.to(torch.float32)
    assert (layer.weight.shape, layer.weight_scale.shape) == ((32, 32), (2, 32, 2))
    half_steps = layer.weight_scale[..., 0].float().t().repeat_interleave(32, 1) / 2   # [N, K]
    with torch.no_grad():   # each weight within half a step; bfloat16 inputs and outputs
        bound = x.abs() @ half_steps.t() + 1e-2 * dense(x).abs().max()
        assert ((layer(x) - dense(x)).abs() <= bound).all()
    head = Int8Linear.quantized(torch.nn.Linear(48, 5)).to(torch.float16)
    assert (head.weight.dtype, head.weight_scale.dtype, head.weight_scale.shape) == \
        (torch.int8, torch.bfloat16, (5,))
    assert head(torch.randn(2, 48, dtype=torch.float16)).dtype == torch.float16


def test_quantization_int4_gives_the_tokens_of_its_dequantized_weights(monkeypatch):
    """The engine computes in bfloat16 where the dense model holding the same weights
    computes in float32: the greedy margins must clear several bfloat16 steps of these
    logits (about 1/32), which seed 10 does (0.099 at the least)."""
    llm, tokens = generate(decisive_model(10, CONFIG), quantization="int4")
    layers = int4_layers(llm.model)
    assert len(layers) == 8 and type(llm.model.lm_head) is Int8Linear
    dense = decisive_model(10, CONFIG)
    with torch.no_grad():
        for name in layers:
            original = dense.get_submodule(name)
            q, scales_zeros = quantize_int4(original.weight)
            assert torch.equal(pack_int4(q), llm.model.get_submodule(name).weight)
            original.weight.copy_(cpu_int4.dequantize(q, scales_zeros))
        q, scale = quantize_int8(dense.lm_head.weight)
        assert torch.equal(q, llm.model.lm_head.weight)
        dense.lm_head.weight.copy_(cpu_int8.dequantize(q, scale))
    margins = greedy_margins(monkeypatch)
    assert tokens == generate(dense)[1]
    assert min(margins) > 0.08
    text = llm.traced.as_text()
    assert INT4 in text and INT8 in text


def test_a_tied_head_becomes_int8_and_the_embedding_keeps_its_table():
    model = decisive_model(6, {**CONFIG, "tie_word_embeddings": True})
    table = model.model.embed_tokens.weight.detach().clone()
    model = quantized_to_int4(model)
    assert type(model.lm_head) is Int8Linear and model.lm_head.weight.dtype == torch.int8
    assert torch.equal(model.model.embed_tokens.weight, table)


def test_quantization_int4_keeps_logits_within_tolerance(monkeypatch):
    dense, _ = prefill_logits(monkeypatch, decisive_model(4, CONFIG))
    quantized, _ = prefill_logits(monkeypatch, decisive_model(4, CONFIG), quantization="int4")
    error = (quantized - dense) / dense.std()
    assert error.pow(2).mean().sqrt() < LOGIT_TOLERANCE["rms"] and error.abs().max() < LOGIT_TOLERANCE["max"]


def test_layers_that_do_not_pack_stay_dense_and_are_named(caplog):
    model = random_model({**TINY_LLAMA, "hidden_size": 48, "intermediate_size": 64,
                          "num_attention_heads": 3, "num_key_value_heads": 1}, seed=0)
    with caplog.at_level(logging.WARNING):
        quantized_to_int4(model)
    assert int4_layers(model) == [f"model.layers.{i}.mlp.down_proj" for i in range(2)]
    assert type(model.lm_head) is Int8Linear
    assert "left 6 layers dense" in caplog.text and "self_attn.qkv_proj [80, 48]" in caplog.text


def test_int4_is_refused_off_the_cpu_and_for_gguf_blocks():
    with pytest.raises(ValueError, match="quantization='int4' runs on the CPU.*not on cuda"):
        checked_quantization("int4", torch.device("cuda"))
    assert checked_quantization("int4", torch.device("cpu")) == "int4"
    from tokenspeed.backends.kernels import cuda
    q, scales_zeros = quantize_int4(torch.randn(16, 32))
    x, packed = torch.randn(1, 32), pack_int4(q)
    for call in (lambda: cuda.linear(x, packed, None, INT4, scales_zeros),
                 lambda: cuda.gated_linear(torch.randn(1, 64), packed, None, INT4, scales_zeros),
                 lambda: cuda.norm_linear(x, None, torch.ones(32), 1e-6, packed, None, INT4, scales_zeros)):
        with pytest.raises(ValueError, match="int4_g32 weights .* run on the CPU only"):
            call()
    from test_gguf_blocks import decisive_file
    from gguf import GGMLQuantizationType as Q
    with pytest.raises(ValueError, match="quantization='int4' quantizes 16- or 32-bit weights.*GGUF blocks"):
        quantized_to_int4(ts.models.load(decisive_file(Q.Q4_0), quantized=True))
