"""Activations quantized to FP8 in one kernel: a scale per row (per token, for
``torch._scaled_mm``) or per row and 128 columns (for block-scaled weights), and the
quantized values, ``fp8_weights.quantize_activation_groups`` computed in one launch.

Prefill multiplies 2048 rows or more, and its FP8 matmul is only about 20 us a projection
on an H200 (1B shapes): the five or so torch kernels of the reference (abs, amax, divide,
clamp, convert, each a pass over the rows) would cost most of what FP8 saves. This kernel
reads a tile of rows once for their largest magnitudes and once more (from L2) to write
them quantized. Before the down projection it can compute the MLP's silu(gate) * up as
it reads the gate_up rows (``gated``), as the GEMVs do; before qkv and gate_up, the layer's
RMSNorm and its residual add (``quantize_normed``): a decode batch past the GEMV's rows
then launches one kernel where it launched the norm's and the quantizer's.

The conversion rounds in fp32 first (``round_to_e4m3``), so ``.to(float8e4nv)`` only
ever sees values it represents exactly: the GPU's conversion and the Triton
interpreter's (which mis-rounds values whose rounding carries into the next exponent,
7.79 to 4.0) then agree, and the tests compare with torch's conversion bit for bit.
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_gemv
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.fp8_weights import ACTIVATION_DTYPES, FP8, FP8_MAX, MIN_AMAX

TILE = 2048  # elements a program holds at a time (16 a thread with 4 warps)
_FP8_MAX = tl.constexpr(FP8_MAX)
_FP8_STEP = tl.constexpr(1 / FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def round_to_e4m3(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest float8_e4m3fn value (ties to even),
    still fp32, its sign kept (-0.0 too). A normal magnitude keeps 3 of fp32's 23 mantissa
    bits (the integer add carries into the exponent as rounding must); below 2^-6 the
    spacing is a fixed 2^-9, and adding 1.5 * 2^14 rounds to it."""
    magnitude = tl.abs(v)
    bits = magnitude.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    subnormal = ((magnitude + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
    return (tl.where(magnitude < 0.015625, subnormal, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _input_tile(x_ptr, res_ptr, nw_ptr, rows, mmask, k, hi, K, stride_xm, inv, GATED: tl.constexpr,
                NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """fp32 ``[ROWS, BLOCK]`` of the input (zeros past ``hi``): x, silu(gate) * up of
    ``[M, 2K]`` rows, or rms_norm(x + residual) * norm weight given the rows' ``inv`` rms,
    rounded to x's dtype as ``triton_gemv`` computes it."""
    mask = mmask[:, None] & (k < hi)[None, :]
    x = triton_gemv._input(x_ptr, res_ptr, nw_ptr, rows * stride_xm + k[None, :], k, mask, K, inv,
                           GATED, NORM, HAS_RES)
    return x.to(tl.float32)


@triton.jit
def _quantize_kernel(x_ptr, res_ptr, nw_ptr, total_ptr, q_ptr, s_ptr, M, K, group, stride_xm, stride_qm,
                     stride_sm, eps, GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row tile, group): the largest magnitude of each row over ``group``
    columns, then those columns quantized with it (the second read hits L2). NORM (one
    group a row): the rows' 1/rms first, the sum x + residual stored as it is read."""
    pdl.start(USE_PDL)
    m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    kk = tl.arange(0, BLOCK)
    lo = g * group
    hi = tl.minimum(lo + group, K)
    rows, mmask = m.to(tl.int64)[:, None], m < M
    pdl.wait(USE_PDL)
    inv = 0.0
    if NORM:
        inv = triton_gemv._inv_rms(x_ptr, res_ptr, total_ptr, m.to(tl.int64), mmask, K, stride_xm, eps, M,
                                   HAS_RES, ROWS, BLOCK)
    amax = tl.zeros([ROWS], tl.float32)
    for k0 in range(lo, hi, BLOCK):
        x = _input_tile(x_ptr, res_ptr, nw_ptr, rows, mmask, k0 + kk, hi, K, stride_xm, inv, GATED, NORM, HAS_RES)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    scale = tl.maximum(amax, _MIN_AMAX) * _FP8_STEP  # a product, as the reference computes it
    tl.store(s_ptr + m * stride_sm + g, scale, mask=mmask)
    inverse = tl.math.div_rn(1.0, scale)  # a product an element, not a quotient
    for k0 in range(lo, hi, BLOCK):
        x = _input_tile(x_ptr, res_ptr, nw_ptr, rows, mmask, k0 + kk, hi, K, stride_xm, inv, GATED, NORM, HAS_RES)
        v = tl.minimum(tl.maximum(x * inverse[:, None], -_FP8_MAX), _FP8_MAX)
        tl.store(q_ptr + rows * stride_qm + k0 + kk[None, :],
                 round_to_e4m3(v).to(q_ptr.dtype.element_ty),
                 mask=mmask[:, None] & (k0 + kk < hi)[None, :])


@attrs.frozen(eq=False)
class _Norm:
    """What ``quantize_normed`` hands the kernel: the residual (None: the norm alone), the
    norm's weight and epsilon, and the sum's output."""
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    total: torch.Tensor | None


def quantize_activations(x: torch.Tensor, group: int | None = None, gated: bool = False):
    """(``float8_e4m3fn [M, K]``, ``float32 [M, ceil(K / group)]``) of ``x [M, K]``: a
    scale per row and ``group`` columns, or per row (``[M, 1]``) when ``group`` is None;
    equal to ``fp8_weights.quantize_activation_groups``. ``gated``: x is ``[M, 2K]``
    (gate, up) and what is quantized silu(gate) * up, which saves the activation's own
    kernel and its output's round trip through memory."""
    _check_activations(x, gated)
    if group is not None and group < 1:
        raise ValueError(f"a quantization group must hold at least 1 column; got {group}")
    return _quantize(x if x.stride(-1) == 1 else x.contiguous(), group, gated, None)


def quantize_normed(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float):
    """(q, scale ``[M, 1]``, sum or None): rms_norm(x + residual) * norm_weight quantized per
    row, and x + residual (rounded to x's dtype) when there is a residual; the norm as
    ``triton_gemv``'s normed GEMVs compute it, so the quantized rows are those of
    ``quantize_activations`` over the norm kernel's output (within a rounding of 1/rms)."""
    _check_activations(x, False)
    k = x.shape[1]
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"the residual {tuple(residual.shape)} must be shaped as x {tuple(x.shape)}")
    if norm_weight.shape != (k,):
        raise ValueError(f"the norm weight {tuple(norm_weight.shape)} must hold x's {k} columns")
    x = x.contiguous()
    residual = None if residual is None else residual.to(x.dtype).contiguous()
    norm = _Norm(residual, norm_weight.contiguous(), float(eps), None if residual is None else torch.empty_like(x))
    q, scale = _quantize(x, None, False, norm)
    return q, scale, norm.total


def _check_activations(x: torch.Tensor, gated: bool) -> None:
    if x.dim() != 2 or x.dtype not in ACTIVATION_DTYPES or (gated and x.shape[1] % 2):
        need = "[M, 2K] (gate, up)" if gated else "[M, K]"
        raise ValueError(f"activations to quantize must be bfloat16, float16 or float32 "
                         f"{need}; got {x.dtype} {tuple(x.shape)}")


def _quantize(x: torch.Tensor, group: int | None, gated: bool, norm: _Norm | None):
    """The launch: ``x`` row-major; ``norm`` only with one group a row."""
    m, k = x.shape[0], x.shape[1] // (2 if gated else 1)
    group = max(k, 1) if group is None else group
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale
    block = min(next_power_of_2(group), TILE)
    rows = max(1, min(16, TILE // block, next_power_of_2(m)))
    res, weight, total = (x, x, x) if norm is None else (
        norm.residual if norm.residual is not None else x, norm.weight, norm.total if norm.total is not None else x)
    _quantize_kernel[(triton.cdiv(m, rows), groups)](
        x, res, weight, total, q, scale, m, k, group, x.stride(0), q.stride(0), scale.stride(0),
        0.0 if norm is None else norm.eps, GATED=gated, NORM=norm is not None,
        HAS_RES=norm is not None and norm.residual is not None, ROWS=rows, BLOCK=block, num_warps=4,
        **pdl.launch_options(x.device))
    return q, scale
