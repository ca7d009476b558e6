"""FP8 weights in a model: checkpoints stored in FP8 (the three common schemes) load and
stay FP8, ``quantization="fp8"`` quantizes a 16-bit model at load, and what is not
supported is refused by name.

On the CPU an FP8 layer runs the reference (its weight times its scales, then the float
matmul), so a model loaded from an FP8 file computes the same products as the dense model
holding those dequantized weights: tokens must be equal. Against the original float
weights, FP8 is within the documented tolerance ``LOGIT_TOLERANCE``.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import tokenspeed as ts
from tokenspeed.backends.kernels.fp8_weights import FP8_MAX, dequantize, quantize_per_channel, to_fp8
from tokenspeed.ir import ops
from tokenspeed.models.fp8_layers import Fp8Linear
from tokenspeed.models.random import TINY_LLAMA, hf_state_dict

from hf_models import make_prompts, new_tmpdir
from margins import decisive_model

# Whole tiles of 128 rows in every stacked part (k and v: 2 heads of 64), as real
# checkpoints have; the tile scheme stacks only such parts.
CONFIG = {**TINY_LLAMA, "hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 4,
          "num_key_value_heads": 2}
GREEDY = ts.SamplingParams(temperature=0, max_tokens=6)
PROMPTS = make_prompts((4, 13), seed=8, vocab=TINY_LLAMA["vocab_size"])
# FP8 logits against float logits, relative to the float logits' spread (std): the root
# mean square and the largest difference (e4m3 keeps 3 mantissa bits, a weight's relative
# error is at most 1/16; seen on these models: 0.04 and 0.16). docs/ARCHITECTURE.md quotes them.
LOGIT_TOLERANCE = {"rms": 0.1, "max": 0.3}
SCHEMES = {
    "fp8-tile": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "static"},
    "compressed-tensors-channel": {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "ignore": ["lm_head"]},
}


def quantize_tiles(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per 128 x 128 tile, as DeepSeek-style files store ``weight_scale_inv``."""
    n, k = w.shape
    tn, tk = -(-n // 128), -(-k // 128)
    amax = F.pad(w, (0, tk * 128 - k, 0, tn * 128 - n)).view(tn, 128, tk, 128).abs().amax((1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    tiles = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return to_fp8(w / tiles), scale


def stored(name: str, w: torch.Tensor, scheme: str) -> dict[str, torch.Tensor]:
    """A matrix as ``scheme`` stores it, and its scales under the scheme's names."""
    base = name.removesuffix(".weight")
    if scheme == "fp8-tile":
        w8, scale = quantize_tiles(w)
        return {name: w8, f"{base}.weight_scale_inv": scale}
    if scheme == "fp8-tensor":
        scale = w.abs().max() / FP8_MAX
        return {name: to_fp8(w / scale), f"{base}.weight_scale": scale.reshape(()),
                f"{base}.input_scale": torch.tensor(0.05)}
    w8, scale = quantize_per_channel(w)
    return {name: w8, f"{base}.weight_scale": scale[:, None]}


def fp8_file(scheme: str, seed: int = 3):
    """A checkpoint directory whose projections ``scheme`` stores in FP8, and the dense
    model of the same (dequantized) weights."""
    model = decisive_model(seed, CONFIG)
    tensors = {}
    for name, w in hf_state_dict(model).items():
        quantize = name.endswith("_proj.weight")
        tensors.update(stored(name, w, scheme) if quantize else {name: w})
    path = new_tmpdir("ts_fp8_")
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": SCHEMES[scheme]}))
    return path, dequantized(model, tensors, scheme)


def dequantized(model, tensors: dict, scheme: str):
    """``model`` holding the weights an FP8 layer computes with (scales as we load them)."""
    state = {}
    for name, t in hf_state_dict(model).items():
        base = name.removesuffix(".weight")
        scale = tensors.get(f"{base}.weight_scale_inv", tensors.get(f"{base}.weight_scale"))
        if scale is not None:
            scale = scale.float().flatten() if scale.dim() < 2 or scale.shape[1] == 1 else scale
            t = dequantize(tensors[name], scale.expand(t.shape[0]).contiguous() if scale.numel() == 1 else scale)
        state[name] = t
    from tokenspeed.models.loader import load_state_dict
    load_state_dict(model, state)
    return model


def generate(model, prompts=PROMPTS, **options):
    llm = ts.LLM(model, device="cpu", enforce_eager=True, max_model_len=64, page_size=4, max_num_seqs=4,
                 **options)
    return llm, [o.token_ids for o in llm.generate(prompts, GREEDY)]


def fp8_layers(model) -> dict[str, bool]:
    return {name: m.tiled for name, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_fp8_checkpoint_loads_fp8_and_gives_the_dequantized_models_tokens(scheme):
    path, reference = fp8_file(scheme)
    llm, tokens = generate(str(path))
    layers = fp8_layers(llm.model)
    assert sorted(layers) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in
                                    ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert set(layers.values()) == {scheme == "fp8-tile"}
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in llm.model.modules() if isinstance(m, Fp8Linear))
    assert tokens == generate(reference)[1]


def test_fp8_layers_show_in_the_graph_with_their_scales():
    path, _ = fp8_file("fp8-tile")
    llm, _ = generate(str(path), prompts=PROMPTS[:1])
    text = llm.traced.as_text()
    assert "fp8_e4m3" in text and "weight_scale" in text


def prefill_logits(monkeypatch, model, **options) -> torch.Tensor:
    """The logits the first prompt's prefill samples from, and the engine's model."""
    from tokenspeed.execution import prefill_runner
    seen = []

    def recorded(logits, *args, **kwargs):
        seen.append(logits.float().clone())
        return sample(logits, *args, **kwargs)

    sample = prefill_runner.sample
    monkeypatch.setattr(prefill_runner, "sample", recorded)
    llm, _ = generate(model, prompts=PROMPTS[1:2], **options)
    monkeypatch.setattr(prefill_runner, "sample", sample)
    return seen[0][-1], llm.model


def test_quantization_fp8_keeps_logits_within_tolerance_and_the_head_dense(monkeypatch):
    dense, _ = prefill_logits(monkeypatch, decisive_model(4, CONFIG))
    quantized, model = prefill_logits(monkeypatch, decisive_model(4, CONFIG), quantization="fp8")
    layers = fp8_layers(model)
    assert len(layers) == 8 and not any(layers.values())
    assert type(model.lm_head) is torch.nn.Linear
    error = (quantized - dense) / dense.std()
    assert error.pow(2).mean().sqrt() < LOGIT_TOLERANCE["rms"] and error.abs().max() < LOGIT_TOLERANCE["max"]


def test_fp8_layer_keeps_its_dtypes_through_a_model_cast():
    with torch.device("meta"):
        layer = Fp8Linear(256, 300, tiled=True, bias=True)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    assert (layer.weight.dtype, layer.weight_scale.dtype, layer.bias.dtype) == \
        (torch.float8_e4m3fn, torch.float32, torch.bfloat16)
    assert layer.weight_scale.shape == (3, 2)


@pytest.mark.parametrize("quant, fragments", [
    ({"quant_method": "awq", "bits": 4}, ["quant_method='awq'", "supported: fp8"]),
    ({"quant_method": "fp8", "weight_block_size": [64, 64]}, ["weight_block_size=[64, 64]", "[128, 128]"]),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                                                "strategy": "group"}}}},
     ["8-bit float weights"]),
])
def test_unsupported_quantization_configs_are_refused_by_name(quant, fragments):
    path, _ = fp8_file("fp8-tile")
    (path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant}))
    with pytest.raises(ValueError) as info:
        ts.models.load(str(path))
    assert all(f in str(info.value) for f in fragments), str(info.value)


def test_a_layer_with_parts_stored_both_ways_is_refused():
    path, _ = fp8_file("fp8-tensor")
    from safetensors.torch import load_file
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.0.self_attn.k_proj"
    tensors[f"{name}.weight"] = dequantize(tensors[f"{name}.weight"],
                                           tensors.pop(f"{name}.weight_scale").expand(128).contiguous())
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="2 of its 3 parts are stored in FP8"):
        ts.models.load(str(path))


def test_bad_quantization_argument_is_refused():
    with pytest.raises(ValueError, match="quantization=.int3.: expected one of fp8, int4, or None .* leave the flag out"):
        ts.LLM(decisive_model(4), device="cpu", quantization="int3")


def test_fp8_linear_op_reference_matches_dequantized_matmul():
    w = torch.randn(40, 64)
    w8, scale = quantize_per_channel(w)
    x = torch.randn(3, 64)
    out = ops.linear(x, w8, None, "fp8_e4m3", scale)
    assert torch.allclose(out, x @ dequantize(w8, scale).T, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 20])
@pytest.mark.parametrize("tiled", [False, True], ids=["channel", "tile"])
def test_cuda_ops_read_fp8_weights_as_the_reference_does(rows, tiled):
    """Each op's CUDA kernel (under the Triton interpreter on a CPU) with an FP8 weight:
    the GEMV forms up to 16 rows, FP8 tensor cores past them, whose activations are
    quantized per token (so within a few e4m3 steps of the products' magnitude)."""
    from tokenspeed.backends.kernels import cuda, reference
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(rows)
    k, n = 256, 144
    w = torch.randn(n, k, generator=gen)
    weight, scale = (t.to(device) for t in (quantize_tiles(w) if tiled else quantize_per_channel(w)))
    x, gate_up, residual = (torch.randn(rows, c, generator=gen).to(device) for c in (k, 2 * k, k))
    norm_weight, bias = torch.rand(k, generator=gen).to(device), torch.randn(n, generator=gen).to(device)
    calls = [("linear", (x, weight, bias, "fp8_e4m3", scale)),
             ("gated_linear", (gate_up, weight, None, "fp8_e4m3", scale)),
             ("norm_linear", (x, residual, norm_weight, 1e-6, weight, bias, "fp8_e4m3", scale)),
             ("norm_linear", (x, None, norm_weight, 1e-6, weight, None, "fp8_e4m3", scale))]
    for name, args in calls:
        got, expected = getattr(cuda, name)(*args), getattr(reference, name)(*args)
        for g, e in zip(*(o if isinstance(o, list) else [o] for o in (got, expected))):
            bound = (1e-4 if rows <= 16 else 0.1) * e.abs().max().item()
            assert (g - e).abs().max().item() <= bound, (name, (g - e).abs().max().item(), bound)


def test_an_fp8_gemv_norms_its_input_only_for_small_weights():
    """Past ``FP8_NORM_GEMV_MAX_WEIGHTS`` every program re-reading the row costs more than the
    norm's launch (H200): the 1B shape's qkv and gate_up take the norm's kernel first."""
    from tokenspeed.backends.kernels import cuda
    fits = [cuda._fuses_norm(torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"), "fp8_e4m3")
            for n, k in ((960, 576), (2048, 2048), (3072, 2048), (16384, 2048))]
    assert fits == [True, True, False, False]


def test_a_checkpoints_kv_cache_scales_reach_the_model():
    """vLLM's ``self_attn.k_scale`` / ``v_scale`` and compressed-tensors' ``output_scale``
    names; a scale that is not positive is refused naming it."""
    from safetensors.torch import load_file
    from tokenspeed.models.kv_scales import kv_scales
    path, _ = fp8_file("fp8-tile")
    tensors = load_file(str(path / "model.safetensors"))
    tensors |= {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
                "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([2.0])}
    save_file(tensors, str(path / "model.safetensors"))
    assert kv_scales(ts.models.load(str(path))).tolist() == [[0.5, 1.0], [1.0, 2.0]]
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(-1.0)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"kv_scales\[0, 0\] = -1.0: a key scale must be finite and > 0"):
        ts.models.load(str(path))
