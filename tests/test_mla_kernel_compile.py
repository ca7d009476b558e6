"""The Triton MLA kernels (decode's, and prefill's of one split a row) compile for an
H100/H200 (sm_90) at DeepSeek-V2-Lite's shapes (latent 512, rope key 64, 16 heads), and
within a program's shared memory at DeepSeek-V3's 128 heads, on a machine without a GPU,
as test_kernel_compile compiles the other kernels: in a child process, outside the
interpreter."""

import sys

import pytest
import torch

from sm90 import assert_compiles

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="GPU tests compile for real")
HOPPER_SHARED_BYTES = 232448   # the shared memory an H100 or H200 gives one program (227 KB)


def mla_decode_kernels():
    from sm90 import compile_sm90
    from tokenspeed.backends.kernels import triton_mla
    names = triton_mla._absorbed_decode_kernel.arg_names
    signature = dict(ql_ptr="*fp32", qr_ptr="*bf16", cache_ptr="*bf16", bt_ptr="*i32", req_ptr="*i64", pos_ptr="*i64",
                     out_ptr="*bf16", mid_o_ptr="*fp32", mid_lse_ptr="*fp32", qk_scale="fp32", cs_ptr="*fp32",
                     **{n: "i32" for n in names if n.startswith("stride")})
    for splits, rotate in [(1, False), (8, False), (8, True)]:   # rotated: q_rope as the projection left it
        flags = dict(HEADS=16, LATENT=512, ROPE=64, PAGE_SIZE=16, NUM_SPLITS=splits, BLOCK_H=16,
                     BLOCK_N=triton_mla.BLOCK_N, BLOCK_R=512, BLOCK_P=64, PRECISION="tf32", ROTATE=rotate,
                     INTERLEAVED=rotate, USE_PDL=rotate)
        ptx = compile_sm90(triton_mla._absorbed_decode_kernel, signature, flags, num_warps=8).asm["ptx"]
        assert ("griddepcontrol.wait" in ptx) == rotate
    for heads, cache, precision in [(128, "*bf16", "tf32"), (128, "*fp32", "ieee")]:   # DeepSeek-V3's heads
        flags = dict(HEADS=heads, LATENT=512, ROPE=64, PAGE_SIZE=16, NUM_SPLITS=8,
                     BLOCK_H=triton_mla.head_block(heads), BLOCK_N=triton_mla.BLOCK_N, BLOCK_R=512, BLOCK_P=64,
                     PRECISION=precision, ROTATE=True, INTERLEAVED=True, USE_PDL=True)
        kernel = compile_sm90(triton_mla._absorbed_decode_kernel, {**signature, "cache_ptr": cache}, flags,
                              num_warps=8)
        assert kernel.metadata.shared <= HOPPER_SHARED_BYTES, (heads, cache, kernel.metadata.shared)
    merge = compile_sm90(triton_mla._combine_kernel, dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", pos_ptr="*i64",
                                                          out_ptr="*fp32", stride_or="i32", stride_oh="i32"),
                         dict(HEADS=16, LATENT=512, NUM_SPLITS=8, BLOCK_N=triton_mla.BLOCK_N, BLOCK_S=8, BLOCK_R=512))
    assert merge.asm["ptx"]
    up = compile_sm90(triton_mla._combine_up_kernel, dict(mid_o_ptr="*fp32", mid_lse_ptr="*fp32", pos_ptr="*i64",
                                                          wv_ptr="*bf16", out_ptr="*bf16", V_DIM="i32",
                                                          stride_wh="i32", stride_wv="i32", stride_or="i32",
                                                          stride_oh="i32"),
                      dict(HEADS=16, LATENT=512, NUM_SPLITS=64, BLOCK_N=triton_mla.BLOCK_N, BLOCK_S=64, BLOCK_R=512,
                           BLOCK_V=16, USE_PDL=True), num_warps=8)
    assert "griddepcontrol.wait" in up.asm["ptx"]
    absorb = compile_sm90(triton_mla._absorb_kernel, dict(qn_ptr="*bf16", wk_ptr="*bf16", out_ptr="*bf16", rows="i32",
                                                          stride_qnr="i32", stride_qnh="i32", stride_wkh="i32",
                                                          stride_wkn="i32", stride_or="i32", stride_oh="i32"),
                          dict(NOPE=128, LATENT=512, BLOCK_D=128, BLOCK_C=triton_mla.ABSORB_COLUMNS, USE_PDL=True),
                          num_warps=triton_mla.ABSORB_WARPS)
    assert "griddepcontrol.wait" in absorb.asm["ptx"]
    names = triton_mla._absorb_write_kernel.arg_names
    write = compile_sm90(triton_mla._absorb_write_kernel, dict(
        qn_ptr="*bf16", wk_ptr="*bf16", out_ptr="*bf16", rows="i32", latent_ptr="*bf16", nw_ptr="*bf16",
        rope_ptr="*bf16", table_ptr="*fp32", pos_ptr="*i64", slot_ptr="*i64", cache_ptr="*bf16", eps="fp32",
        **{n: "i32" for n in names if n.startswith("stride")}),
        dict(NOPE=128, LATENT=512, BLOCK_D=128, BLOCK_C=triton_mla.ABSORB_COLUMNS, HALF=32,
             INTERLEAVED=True, BLOCK_L=512, BLOCK_HALF=32, USE_PDL=True), num_warps=triton_mla.ABSORB_WARPS)
    assert write.asm["ptx"].count("griddepcontrol.wait") >= 2   # the writing programs wait, and the absorbing


def test_the_mla_decode_and_prefill_compile_for_sm90():
    assert_compiles([__file__, "mla_decode_kernels"])


if __name__ == "__main__":
    globals()[sys.argv[1]]()
