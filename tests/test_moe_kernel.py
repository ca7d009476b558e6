"""The fused MoE Triton kernel (``triton_moe``) against the op's reference.

On CPU under the Triton interpreter on small float32 shapes (odd widths, one to 17
tokens); the ``gpu`` tests run bfloat16 at Qwen3-30B-A3B's expert shapes.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings, strategies as st  # noqa: E402

from tokenspeed.backends.kernels import (cuda, moe_reference, reference, triton_moe, triton_moe_align,  # noqa: E402
                                         triton_moe_pairs)
from tokenspeed.errors import InternalError  # noqa: E402

from sm90 import assert_compiles  # noqa: E402
from test_moe import routed  # noqa: E402

FEW = settings(max_examples=15, deadline=None, derandomize=True)
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
gpu = pytest.mark.gpu   # skipped without CUDA (conftest); selected by -m gpu


KERNELS = {"grouped": triton_moe.moe_grouped, "by_pairs": triton_moe_pairs.moe_by_pairs}
both_kernels = pytest.mark.parametrize("kernel", list(KERNELS.values()), ids=list(KERNELS))


def on_device(*tensors, dtype=None):
    return [t.to(DEVICE, dtype=dtype if t.is_floating_point() and dtype else t.dtype) for t in tensors]


@pytest.mark.parametrize("kernel, tokens", [(KERNELS["grouped"], t) for t in (1, 3, 17)] +
                         [(KERNELS["by_pairs"], t) for t in (1, 3)], ids=["grouped-1", "grouped-3", "grouped-17",
                                                                          "by_pairs-1", "by_pairs-3"])
@pytest.mark.parametrize("experts", [4, 8])
@pytest.mark.parametrize("k", [1, 2])
def test_kernel_matches_the_reference(kernel, tokens, experts, k):
    """Widths 48 and 40: neither is a multiple of a tile, and the pair path's 40-column
    reduction is one masked tile."""
    x, w13, w2, weights, ids = on_device(*routed(tokens, experts, k, 48, 40, seed=tokens * experts + k))
    out = kernel(x, w13, w2, weights, ids.int())
    torch.testing.assert_close(out, moe_reference.moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_a_few_tokens_go_by_pair_and_more_by_expert_blocks(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_moe_pairs, "moe_by_pairs", lambda *a, **k: calls.append("pairs"))
    monkeypatch.setattr(triton_moe, "moe_grouped", lambda *a: calls.append("grouped"))
    for tokens in (1, triton_moe_pairs.MAX_TOKENS, triton_moe_pairs.MAX_TOKENS + 1):
        x, w13, w2, weights, ids = routed(tokens, 8, 2, 48, 40, seed=tokens)
        triton_moe.moe(x, w13, w2, weights, ids)
    assert calls == ["pairs", "pairs", "grouped"]


@both_kernels
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=gpu)])
def test_the_shared_experts_output_is_added_in_the_activations_dtype(kernel, dtype):
    """``moe(..., shared)``: the combined rows rounded to x's dtype, then that dtype's sum
    with ``shared`` (DeepSeek's ``routed + shared_experts(x)``), to the bit. (bfloat16 on the
    GPU only: the interpreter's bfloat16 products are not the oracle's.)"""
    x, w13, w2, weights, ids = on_device(*routed(3, 8, 2, 48, 40, seed=3), dtype=dtype)
    shared = torch.randn(3, 48, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    alone = kernel(x, w13, w2, weights, ids)
    assert torch.equal(kernel(x, w13, w2, weights, ids, shared), alone + shared)
    want = moe_reference.moe(x, w13, w2, weights, ids, shared)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(kernel(x, w13, w2, weights, ids, shared), want, rtol=tol, atol=tol)


def shared_mlp(hidden: int, inter: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return triton_moe_pairs.SharedExperts(torch.randn(2 * inter, hidden, generator=gen) / hidden ** 0.5,
                                          torch.randn(hidden, inter, generator=gen) / inter ** 0.5)


@pytest.mark.parametrize("tokens, shared_inter, k", [(1, 80, 2), (2, 80, 1), (2, 40, 2), (1, 27, 2), (2, 61, 2)],
                         ids=["two_chunks", "two_chunks_two_tokens", "one_chunk", "narrower", "ragged"])
def test_the_pair_launches_run_the_shared_experts_mlp(tokens, shared_inter, k):
    """DeepSeek's shared experts (widths 2 x, 1 x and not a multiple of the routed experts'
    40): their MLP of x, added as their own projections' output is (``reference.moe``)."""
    x, w13, w2, weights, ids = on_device(*routed(tokens, 8, k, 48, 40, seed=tokens + k))
    experts = triton_moe_pairs.SharedExperts(*on_device(*shared_mlp(48, shared_inter, seed=shared_inter)))
    got = triton_moe_pairs.moe_by_pairs(x, w13, w2, weights, ids.int(), shared_experts=experts)
    want = reference.moe(x, w13, w2, weights, ids, shared_w13=experts.w13, shared_w2=experts.w2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_cuda_op_runs_the_shared_experts_where_the_step_goes(tokens):
    """By pair they run inside the launches; by expert blocks their projections run first."""
    x, w13, w2, weights, ids = on_device(*routed(tokens, 8, 2, 48, 40, seed=tokens))
    experts = on_device(*shared_mlp(48, 80, seed=5))
    got = cuda.moe(x, w13, w2, weights, ids, shared_w13=experts[0], shared_w2=experts[1])
    want = reference.moe(x, w13, w2, weights, ids, shared_w13=experts[0], shared_w2=experts[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shared_experts_come_as_weights_or_as_an_output_not_both():
    x, w13, w2, weights, ids = routed(1, 8, 2, 48, 40, seed=1)
    experts = shared_mlp(48, 80, seed=5)
    with pytest.raises(InternalError, match="output or their weights, not both"):
        triton_moe_pairs.moe_by_pairs(x, w13, w2, weights, ids, torch.zeros(1, 48), shared_experts=experts)
    with pytest.raises(InternalError, match=r"w13 must be \[2 \* I_s, 48\]"):
        triton_moe_pairs.moe_by_pairs(x, w13, w2, weights, ids, shared_experts=(experts.w13[:-1], experts.w2))
    with pytest.raises(InternalError, match="this step has 3"):
        triton_moe.moe(*routed(3, 8, 2, 48, 40, seed=1), shared_experts=experts)


def check_blocks(ids: torch.Tensor, experts: int, block_m: int) -> None:
    """Each pair exactly once, in a block of its expert, in token order; the rest padding."""
    grouped = triton_moe_align.expert_blocks(ids.to(DEVICE), experts, block_m)
    slots, owners = grouped.slots.cpu().long(), grouped.experts.cpu().long().repeat_interleave(block_m)
    pairs = ids.numel()
    assert len(grouped.experts) == triton_moe_align.max_blocks(pairs, experts, block_m)
    real = slots < pairs
    assert sorted(slots[real].tolist()) == list(range(pairs))
    assert torch.equal(owners[real], ids.reshape(-1)[slots[real]])
    assert bool((slots[~real] == pairs).all())
    for block in slots.view(-1, block_m):
        kept = block[block < pairs]
        assert torch.equal(kept, kept.sort().values)


@FEW
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 3), st.sampled_from([4, 16]))
def test_every_pair_sits_in_one_block_of_its_expert(tokens, experts, k, block_m):
    k = min(k, experts)
    check_blocks(torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens)).topk(k).indices,
                 experts, block_m)


@pytest.mark.parametrize("tokens, experts, k", [(300, 200, 4), (300, 128, 8)])
def test_grouping_over_many_chunks(tokens, experts, k):
    """More pairs than one chunk of the one-hot holds, and (200 experts) more chunks than one
    tile of the plan."""
    gen = torch.Generator().manual_seed(experts)
    check_blocks(torch.randn(tokens, experts, generator=gen).topk(k).indices, experts, 16)
    skewed = torch.stack([torch.randperm(8, generator=gen)[:k] for _ in range(tokens)])  # 8 busy experts
    check_blocks(skewed, experts, 64)


@pytest.mark.parametrize("kernel, padding", [(KERNELS["grouped"], 1), (KERNELS["grouped"], 6),
                                             (KERNELS["by_pairs"], 1)], ids=["grouped-1", "grouped-6", "by_pairs-1"])
def test_padding_rows_leave_real_rows_alone(kernel, padding):
    x, w13, w2, weights, ids = on_device(*routed(2, 8, 2, 48, 40, seed=1))
    pad = on_device(*routed(padding, 8, 2, 48, 40, seed=2))
    out = kernel(torch.cat([x, 1e3 * pad[0]]), w13, w2, torch.cat([weights, pad[3]]), torch.cat([ids, pad[4]]))
    torch.testing.assert_close(out[:2], kernel(x, w13, w2, weights, ids), rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.parametrize("tokens", [1, 3, 32, 300])
def test_kernel_at_qwen3_30b_shapes(tokens):
    x, w13, w2, weights, ids = on_device(*routed(tokens, 128, 8, 2048, 768, seed=tokens), dtype=torch.bfloat16)
    out = triton_moe.moe(x, w13, w2, weights.float(), ids)
    want = moe_reference.moe(*on_device(x, w13, w2, weights, ids, dtype=torch.float32))
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


@gpu
@pytest.mark.parametrize("tokens", [2, 8])
def test_kernel_in_a_cuda_graph_follows_new_routing(tokens):
    x, w13, w2, weights, ids = on_device(*routed(tokens, 16, 2, 256, 128, seed=4), dtype=torch.bfloat16)
    triton_moe.moe(x, w13, w2, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.moe(x, w13, w2, weights, ids)
    ids.copy_(torch.flip(ids, dims=(0,)))
    graph.replay()
    torch.testing.assert_close(out, triton_moe.moe(x, w13, w2, weights, ids), rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Qwen3MoeForCausalLM"])
def test_float32_mixtures_of_experts_match_hugging_face(arch, enforce_eager):
    """Through the Triton kernels and captured graphs; prompts up to 137 tokens, 16 at once."""
    import transformers
    import tokenspeed as ts
    from tokenspeed.models.config import ModelConfig
    from tokenspeed.models.loader import build, load_state_dict
    config_cls, model_cls = {"MixtralForCausalLM": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
                             "Qwen3MoeForCausalLM": (transformers.Qwen3MoeConfig,
                                                     transformers.Qwen3MoeForCausalLM)}[arch]
    config = config_cls(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=96,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = model_cls(config).to("cuda").eval()
    ours = build(ModelConfig.from_hf({**config.to_dict(), "architectures": [arch]}), torch.float32, "cuda")
    load_state_dict(ours, hf.state_dict())
    prompts = [[(3 + 11 * i + j) % 500 for j in range(2 + 9 * i)] for i in range(16)]
    llm = ts.LLM(ours, device="cuda", page_size=16, max_num_seqs=10, max_num_batched_tokens=128,
                 max_model_len=512, enforce_eager=enforce_eager)
    for p, out in zip(prompts, llm.generate(prompts, ts.SamplingParams(temperature=0.0, max_tokens=40))):
        ref = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=40, do_sample=False)
        assert list(out.token_ids) == ref[0, len(p):].tolist()[:len(out.token_ids)]


@pytest.mark.skipif(HAS_CUDA, reason="the tiny run is the CPU's check")
def test_the_benchmark_runs_tiny(tmp_path, monkeypatch):
    import json
    import sys
    from benchmarks import moe_kernel
    out = tmp_path / "moe.json"
    monkeypatch.setattr(sys, "argv", ["moe_kernel", "--tiny", "--tokens", "1", "9", "--json", str(out)])
    moe_kernel.main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["shape"], r["tokens"]) for r in rows] == [(s, t) for s in moe_kernel.SHAPES for t in (1, 9)]
    assert all(1 <= r["experts_touched"] <= 8 and r["us"] > 0 for r in rows)


SM90 = """
from sm90 import compile_sm90
from tokenspeed.backends.kernels import triton_moe as m, triton_moe_align as a
assert compile_sm90(a._count_kernel, dict(ids_ptr="*i32", counts_ptr="*i32", pairs="i32"),
                    dict(CHUNK=64, E=128)).asm["ptx"]
assert compile_sm90(a._plan_kernel, dict(counts_ptr="*i32", starts_ptr="*i32", slots_ptr="*i32",
                    block_experts_ptr="*i32", pairs="i32", chunks="i32", num_blocks="i32", num_experts="i32"),
                    dict(BLOCK_M=64, TILE=64, E=128, FILL=1024)).asm["ptx"]
assert compile_sm90(a._place_kernel, dict(ids_ptr="*i32", counts_ptr="*i32", starts_ptr="*i32", slots_ptr="*i32",
                    pairs="i32"), dict(CHUNK=64, E=128)).asm["ptx"]
strides = dict(stride_we="i64", stride_wn="i32", stride_am="i32")
for tile in (m.tiles(1, 128), m.tiles(1024, 128)):   # decode's and prefill's
    tiles = dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, PRECISION="tf32")
    gate_up = compile_sm90(m._gate_up_kernel, dict(x_ptr="*bf16", w13_ptr="*bf16", slots_ptr="*i32",
                           experts_ptr="*i32", act_ptr="*bf16", pairs="i32", H="i32", I="i32", top_k="i32",
                           num_experts="i32", stride_xt="i32", **strides), tiles)
    down = compile_sm90(m._down_kernel, dict(act_ptr="*bf16", w2_ptr="*bf16", slots_ptr="*i32",
                        experts_ptr="*i32", weights_ptr="*fp32", out_ptr="*fp32", pairs="i32", H="i32", I="i32",
                        num_experts="i32", stride_os="i32", **strides), tiles)
    assert "wgmma" in gate_up.asm["ptx"] + down.asm["ptx"] or "mma" in gate_up.asm["ptx"]
from tokenspeed.backends.kernels import triton_moe_pairs as p
tiles = p.PairTiles()
pdl = dict(USE_PDL=True)
for chunks in (1, 2):   # with the shared experts' MLP as two pairs a token (DeepSeek-V2-Lite's)
    assert compile_sm90(p._pair_gate_up_kernel, dict(x_ptr="*bf16", w13_ptr="*bf16", ids_ptr="*i64",
                        act_ptr="*bf16", ws13_ptr="*bf16", H="i32", I="i32", I_S="i32", top_k="i32",
                        routed_pairs="i32", stride_xt="i32", stride_we="i64", stride_wn="i32", stride_wsn="i32"),
                        dict(CHUNKS=chunks, BLOCK_N=tiles.gate_up_n, BLOCK_K=tiles.gate_up_k, **pdl)).asm["ptx"]
for shared, chunks in ((True, 0), (False, 2)):
    assert compile_sm90(p._pair_down_kernel, dict(act_ptr="*bf16", w2_ptr="*bf16", ids_ptr="*i64",
                        weights_ptr="*fp32", shared_ptr="*bf16", out_ptr="*bf16", ws2_ptr="*bf16", H="i32", I="i32",
                        I_S="i32", routed_pairs="i32", stride_we="i64", stride_wn="i32", stride_s="i32",
                        stride_wsn="i32"),
                        dict(K=6, HAS_SHARED=shared, CHUNKS=chunks, BLOCK_J=8, BLOCK_N=tiles.down_n,
                             BLOCK_K=tiles.down_k, **pdl)).asm["ptx"]
"""


@pytest.mark.skipif(HAS_CUDA, reason="GPU tests compile for real")
def test_the_kernels_compile_for_sm90():
    """As tests/test_kernel_compile.py does for the others: in a child, without the interpreter."""
    assert_compiles(["-c", SM90])
