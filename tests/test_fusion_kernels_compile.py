"""This session's fused kernels compile for an H100/H200 (sm_90) on a machine without a GPU,
as ``test_kernel_compile`` compiles the others (a child process, outside the interpreter):
the rotary, the router's softmax and top k (alone, after the gate's product, and that after
the norm), DeepSeek's grouped choice (V3's and V2's; and Moonlight's after its
normed gate), the latent
write, the MoE combine with the shared experts' add and the one-launch expert grouping, at
DeepSeek-V2-Lite's and Qwen3-30B-A3B's shapes, with programmatic dependent launch on where
the kernel takes it."""

import sys

import pytest
import torch

from sm90 import assert_compiles

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="GPU tests compile for real")


def fused_kernels():
    from sm90 import compile_sm90
    from tokenspeed.backends.kernels import (triton_group_route, triton_latent, triton_moe, triton_moe_align, triton_rope,
                                             triton_route)
    def i32(kernel):   # its integer arguments
        return {n: "i32" for n in kernel.arg_names
                if n.startswith(("stride", "num_", "pairs", "hidden")) and not n.endswith("_ptr")}
    rope = compile_sm90(triton_rope._rope_kernel, dict(x_ptr="*bf16", table_ptr="*fp32", pos_ptr="*i64",
                                                       out_ptr="*bf16", **i32(triton_rope._rope_kernel)),
                        dict(HALF=32, INTERLEAVED=True, BLOCK_H=16, BLOCK_HALF=32, USE_PDL=True))
    route = compile_sm90(triton_route._softmax_top_k_kernel, dict(logits_ptr="*fp32", weights_ptr="*fp32",
                                                                  ids_ptr="*i64", scale="fp32",
                                                                  **i32(triton_route._softmax_top_k_kernel)),
                         dict(K=8, NORMALIZE=True, BLOCK_E=128, BLOCK_K=8, USE_PDL=True))
    latent = compile_sm90(triton_latent._latent_write_kernel, dict(
        latent_ptr="*bf16", w_ptr="*bf16", rope_ptr="*bf16", table_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64",
        cache_ptr="*bf16", eps="fp32", **i32(triton_latent._latent_write_kernel)),
        dict(LATENT=512, HALF=32, INTERLEAVED=True, BLOCK_L=512, BLOCK_HALF=32, USE_PDL=True))
    combine = compile_sm90(triton_moe._combine_kernel, dict(pairs_ptr="*fp32", shared_ptr="*bf16", out_ptr="*bf16",
                                                            **i32(triton_moe._combine_kernel)),
                           dict(K=6, HAS_SHARED=True, BLOCK=1024))
    group = compile_sm90(triton_moe_align._group_kernel, dict(ids_ptr="*i64", slots_ptr="*i32",
                                                              block_experts_ptr="*i32",
                                                              **i32(triton_moe_align._group_kernel)),
                         dict(CHUNK=256, E=128, BLOCK_M=16, TILE=64, FILL=1024))
    gates = [compile_sm90(triton_route._route_kernel, dict(
        x_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", cnt_ptr="*i32",
        scale="fp32", rows="i32", res_ptr="*bf16", nw_ptr="*bf16", normed_ptr="*bf16", total_ptr="*bf16", eps="fp32",
        bias_ptr="*fp32", per_group="i32", n_group="i32", **i32(triton_route._route_kernel)),
        dict(K=6, NORMALIZE=grouped, ROUND=False, NORM=norm, HAS_RES=norm, GROUPED=grouped, TOPK_GROUP=1,
             NOAUX=grouped, BLOCK_N=8, BLOCK_K=256, BLOCK_E=64, BLOCK_S=8, BLOCK_TOP=8, BLOCK_H=2048, BLOCK_G=1,
             USE_PDL=True)) for norm, grouped in ((False, False), (True, False), (True, True))]
    choices = [compile_sm90(triton_group_route._group_top_k_kernel, dict(
        logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i64", per_group="i32", n_group="i32",
        scale="fp32", **i32(triton_group_route._group_top_k_kernel)),
        dict(K=k, TOPK_GROUP=topk_group, NOAUX=noaux, NORMALIZE=noaux, BLOCK_E=256, BLOCK_G=8, BLOCK_K=8, USE_PDL=True))
        for k, topk_group, noaux in ((8, 4, True), (6, 3, False))]
    assert all(k.asm["ptx"] for k in (rope, route, latent, combine, group, *gates, *choices))
    assert "bar.sync" in group.asm["ptx"]   # the rows are marked empty before the pairs land
    assert all("atom.global.gpu.acq_rel.add" in g.asm["ptx"] for g in gates)   # the last program counts itself in
    assert gates[1].asm["ptx"].count("st.global") > gates[0].asm["ptx"].count("st.global")   # normed rows, sum


def test_the_fused_kernels_compile_for_sm90():
    assert_compiles([__file__, "fused_kernels"])


if __name__ == "__main__":
    globals()[sys.argv[1]]()
