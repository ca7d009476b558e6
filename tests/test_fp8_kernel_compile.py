"""The FP8 weight kernels compile for an H100/H200 (sm_90) on a machine without a GPU, as
tests/test_kernel_compile.py checks the others: in a child, without the interpreter,
with the chosen configs and the alignment a launch specializes. The block matmul must
reach the FP8 tensor cores, and the activation quantizer's scale is an IEEE quotient, as
torch's is (Triton's ``/`` is an approximate one); the quantizer compiles with the norm
before it, as a decode batch past the GEMV's rows launches it."""

import pytest
import torch

from sm90 import assert_compiles

SM90 = """
import sm90
from tokenspeed.backends.kernels import triton_fp8_block_matmul as b, triton_fp8_gemv as g, triton_fp8_quantize as q

def compile_sm90(kernel, signature, constexprs, num_warps, num_stages=3):
    return sm90.compile_sm90(kernel, signature, constexprs, num_warps, num_stages).asm["ptx"]

ints = lambda *names: {n: "i32" for n in names}
gemv = dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", total_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32",
            bias_ptr="*bf16", out_ptr="*bf16", eps="fp32",
            **ints("M", "N", "K", "k_per_split", "stride_xm", "stride_wn", "stride_sn", "stride_os", "stride_om"))
for rows in (1, 16):
    for n, k in ((2048, 8192), (3072, 2048)):
        c = g.choose_config(rows, n, k, 132)
        for blocks in (False, True):
            normed = rows == 1 and k == 2048   # the one-row norm of a layer's first projection
            ptx = compile_sm90(g._gemv_kernel, gemv, dict(HAS_BIAS=True, GATED=k == 8192, NORM=normed, HAS_RES=normed,
                               BLOCK_SCALES=blocks, BLOCK_M=1 if rows == 1 else 16, BLOCK_N=c.block_n,
                               BLOCK_K=c.block_k, PRECISION="tf32", USE_PDL=True), c.num_warps, c.num_stages)
            assert "griddepcontrol.wait" in ptx
matmul = dict(xq_ptr="*fp8e4nv", xs_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
              **ints("M", "N", "K", "k_per_split", "stride_xm", "stride_xsm", "stride_wn", "stride_wsn", "stride_os", "stride_om"))
for rows in (16, 300, 2048):
    c = b.choose_config(rows, 2048, 8192, 132)
    ptx = compile_sm90(b._matmul_kernel, matmul, dict(HAS_BIAS=False, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BAND_M=8,
                       USE_PDL=True), c.num_warps, c.num_stages)
    assert "e4m3.e4m3" in ptx and "wgmma" in ptx, "FP8 tensor cores"
quant = dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", total_ptr="*bf16", q_ptr="*fp8e4nv", s_ptr="*fp32",
             eps="fp32", **ints("M", "K", "group", "stride_xm", "stride_qm", "stride_sm"))
for gated, norm, res, rows, block in ((False, False, False, 16, 128), (True, False, False, 16, 128),
                                      (False, True, True, 1, 2048), (False, True, False, 1, 2048)):
    ptx = compile_sm90(q._quantize_kernel, quant, dict(GATED=gated, NORM=norm, HAS_RES=res, ROWS=rows, BLOCK=block,
                       USE_PDL=True), 4)
    assert "div.rn.f32" in ptx and "e4m3" in ptx
"""


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="GPU tests compile for real")
def test_the_kernels_compile_for_sm90():
    assert_compiles(["-c", SM90])
