"""``tokenspeed::rope`` and ``norm_rope_write_latent``: the Triton kernels (under the
interpreter on the CPU) against the references, the reference against the models' rotary
modules, and the passes that put them in place of DeepSeek's rotaries and latent write."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

import tokenspeed as ts  # noqa: E402
from tokenspeed.backends.kernels import reference, triton_latent, triton_rope  # noqa: E402
from tokenspeed.errors import InternalError  # noqa: E402
from tokenspeed.ir.ops import (MLA_DECODE_ATTENTION, MLA_WRITE_DECODE_ATTENTION, NORM_ROPE_WRITE_LATENT,  # noqa: E402
                               ROPE, WRITE_LATENT)
from tokenspeed.models.config import ModelConfig  # noqa: E402
from tokenspeed.models.mla_rotary import MlaRotary  # noqa: E402
from tokenspeed.models.random import random_model  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
    "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 24,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
    "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5},
}


def table(dim: int, positions: int = 64) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(DEVICE)


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(0, 5), heads=st.sampled_from([1, 3, 16]), dim=st.sampled_from([8, 64]),
       interleaved=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
def test_the_kernel_rotates_as_the_reference(rows, heads, dim, interleaved, dtype, seed):
    """A strided input (the rope part of a wider query, as the models split it) included."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, heads, dim + 8, generator=gen).to(DEVICE, dtype)
    x = wide[..., 8:]
    positions = torch.randint(0, 64, (rows,), generator=gen).to(DEVICE)
    cos_sin = table(dim)
    got = triton_rope.rope(x, cos_sin, positions, interleaved)
    want = reference.rope(x.float(), cos_sin, positions, interleaved)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_the_kernel_refuses_an_odd_dimension():
    x = torch.zeros(2, 1, 7, device=DEVICE)
    with pytest.raises(InternalError, match=r"D even"):
        triton_rope.rope(x, torch.zeros(4, 7, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE),
                         False)


@pytest.mark.parametrize("interleaved", [False, True])
def test_the_reference_over_the_shared_table_is_deepseeks_rotary(interleaved):
    """The pass reads one table over every position; the rows it gathers are the ones the
    model's rotary computes for its positions (YaRN's attention factor in), to the bit."""
    v3 = {"architectures": ["DeepseekV3ForCausalLM"], "topk_method": "noaux_tc"}   # V2 always interleaves
    config = ModelConfig.from_hf({**TINY_DEEPSEEK, **({} if interleaved else v3), "rope_interleave": interleaved})
    rotary = MlaRotary(config.mla, config.rope_theta)
    assert rotary.attention_factor != 1.0
    x, positions = torch.randn(5, 4, 16), torch.tensor([0, 3, 17, 200, 255])
    shared = rotary.cos_sin(torch.arange(config.max_position_embeddings))
    assert torch.equal(reference.rope(x, shared, positions, interleaved), rotary(x, positions))


@pytest.mark.parametrize("mode", ["decode", "prefill"])
def test_a_latent_layer_rotates_its_query_in_one_op_and_writes_its_key_in_another(mode):
    """Prefill's query in a ``rope`` op; decode's in its attention (``fuse_latent_query_rope``),
    which writes the key too (``fuse_latent_write_attention``)."""
    model = random_model(TINY_DEEPSEEK)
    lowered = ts.trace(model).lower(mode)
    nodes = [n for seg in lowered.segments for n in seg.graph_module.graph.nodes]
    assert not [n for n in nodes if n.op == "call_module" and "rotary" in str(n.target)]
    layers = TINY_DEEPSEEK["num_hidden_layers"]
    query_ropes = 0 if mode == "decode" else layers
    writes = 0 if mode == "decode" else layers
    assert [len([n for n in nodes if n.target == t]) for t in (ROPE, NORM_ROPE_WRITE_LATENT, WRITE_LATENT)] == \
        [query_ropes, writes, 0]
    fused = [n for n in nodes if n.target == MLA_WRITE_DECODE_ATTENTION]
    assert len(fused) == layers - writes and not [n for n in nodes if n.target == MLA_DECODE_ATTENTION]
    assert {"rope_kernels", "fuse_latent_write"} <= {entry.pass_name for entry in lowered.history}


@settings(max_examples=8, deadline=None, derandomize=True)
@given(rows=st.integers(0, 4), interleaved=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 99))
def test_the_latent_write_stores_the_references_rows(rows, interleaved, dtype, seed):
    """Into the rows' own slots of one layer, nothing else (the cache starts as NaN); the slots
    a strided column, as a model of several cache groups passes them."""
    gen, width, dim, page = torch.Generator().manual_seed(seed), 24, 8, 4
    kv_a = torch.randn(rows, width + dim, generator=gen).to(DEVICE, dtype)        # latent | rope key, as split
    latent, k_rope = kv_a[:, :width], kv_a[:, width:].view(-1, 1, dim)
    weight = (torch.rand(width, generator=gen) + 0.5).to(DEVICE, dtype)
    positions = torch.randint(0, 64, (rows,), generator=gen).to(DEVICE)
    slots = (torch.randperm(12, generator=gen)[:rows] + page).to(DEVICE)          # never page 0
    slots = torch.stack((slots, torch.zeros_like(slots)), dim=1)[:, 0]
    got, want = (torch.full((2, 1, 4, page, 1, width + dim), float("nan"), device=DEVICE, dtype=dtype)
                 for _ in range(2))
    triton_latent.norm_rope_write_latent(latent, weight, 1e-6, k_rope, table(dim), positions, interleaved, got, 1,
                                         slots)
    reference.norm_rope_write_latent(latent, weight, 1e-6, k_rope, table(dim), positions, interleaved, want, 1,
                                     slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, equal_nan=True)
