"""Matrix-vector product over a GGUF weight: ``x [1, K] @ W[N, K].T`` for a decode step
of one row, W read as its blocks (``gguf_blocks.py``) and decoded in registers.

One row only streams the weight, so speed is the bytes read: a quantized weight is 2-4x
fewer than bf16. Each program owns ``BLOCK_N`` output rows and walks K in tiles of
``GROUPS`` scale groups, summing each group's quants times the input in fp32 (no
tensor-core padding for one row) before it applies the group's scale and offset, and the
groups once at the end; K is split over programs (their partial sums added by a second
kernel) where the column blocks alone leave SMs idle. Under PDL the first weight tile is
decoded before the program waits for the kernel that writes x. As ``triton_gemv`` does
for bf16 weights (and with its input code), the input may be computed as it is read:
silu(gate) * up, or rms_norm(x + residual) * weight; every program computes the whole
input, so the engine fuses only the norm, and only for weights of few rows
(``cuda.norm_linear``). Several rows go to ``triton_gguf_matmul`` (tensor cores, the
weight still read once for up to 64 rows).
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_attention, triton_gemv
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.gguf_blocks import BlockFormat, check_linear, check_weight
from tokenspeed.backends.kernels.triton_gemv import InputNorm, split_k
from tokenspeed.backends.kernels.triton_gguf_dequant import Q4_1, Q4_K, Q5_1, Q5_K, weight_parts


@attrs.frozen
class GemvConfig:
    """Output rows per program, scale groups per K tile, K splits (each a program, summed
    by a second kernel), and the launch's warps."""
    block_n: int
    groups: int
    splits: int
    num_warps: int


@triton.jit
def _row_groups(x_ptr, res_ptr, nw_ptr, k, k_hi, K, inv, GATED: tl.constexpr,
                NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """fp32 input values at ``k`` (``[1, GROUPS, GROUP]``, the weight tile's groups; zeros
    from ``k_hi``), computed and rounded as the bf16 GEMV computes them."""
    mask = k < k_hi
    ty = x_ptr.dtype.element_ty
    if GATED:
        x = triton_gemv.silu_mul(tl.load(x_ptr + k, mask=mask, other=0.0),
                                 tl.load(x_ptr + k + K, mask=mask, other=0.0), ty)
    elif NORM:
        h = triton_gemv._hidden(x_ptr, res_ptr, k, mask, HAS_RES)
        x = triton_gemv.normed(h, tl.load(nw_ptr + k, mask=k < K, other=0.0), inv[:, None, None], ty)
    else:
        x = tl.load(x_ptr + k, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _group_dots(parts, x, FORMAT: tl.constexpr):
    """``[R, G, 1]``: each group's products summed, then scaled (``group_parts``)."""
    q, scale, offset = parts
    dots = tl.sum(q * x, 2, keep_dims=True) * scale
    if FORMAT == Q4_1 or FORMAT == Q5_1 or FORMAT == Q4_K or FORMAT == Q5_K:
        dots += tl.sum(x, 2, keep_dims=True) * offset
    return dots


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, total_ptr, w_ptr, bias_ptr, out_ptr, N, K,
                 k_per_split, stride_wn, stride_os, eps, FORMAT: tl.constexpr,
                 TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                 NORM: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUPS: tl.constexpr, GROUP: tl.constexpr, USE_PDL: tl.constexpr):
    """GATED: x is (gate, up), the input silu(gate) * up; NORM: rms_norm(x + residual) *
    norm weight, its statistics read first, the sum written by the first program. Tiles
    stay ``[rows, groups, group]`` and each group's products are summed as they come: a
    reshape to 2-D cost a layout change a tile and a whole-tile accumulator its registers
    (2.0-3.2x slower on the H200)."""
    pdl.start(USE_PDL)
    first = tl.program_id(0) * BLOCK_N
    rows_ptr = w_ptr + first.to(tl.int64) * stride_wn
    local = tl.arange(0, BLOCK_N)
    n = first + local
    nmask, split = n < N, tl.program_id(1)
    BLOCK_K: tl.constexpr = GROUPS * GROUP
    k_in_tile = tl.arange(0, GROUPS)[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w = weight_parts(rows_ptr, local, nmask, k_lo // GROUP, k_hi // GROUP, stride_wn, FORMAT,
                     TYPE_SIZE, GROUPS, GROUP)
    pdl.wait(USE_PDL)
    inv = tl.zeros([1], tl.float32)
    if NORM:
        row = tl.arange(0, 1)
        write_rows = tl.where((tl.program_id(0) == 0) & (split == 0), 1, 0)
        inv = triton_gemv._inv_rms(x_ptr, res_ptr, total_ptr, row, row < 1, K, 0, eps,
                                   write_rows, HAS_RES, 1, BLOCK_K)
    acc = _group_dots(w, _row_groups(x_ptr, res_ptr, nw_ptr, k_lo + k_in_tile, k_hi, K, inv, GATED,
                                     NORM, HAS_RES), FORMAT)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # the first tile came before the wait
        w = weight_parts(rows_ptr, local, nmask, k0 // GROUP, k_hi // GROUP, stride_wn, FORMAT,
                         TYPE_SIZE, GROUPS, GROUP)
        acc += _group_dots(w, _row_groups(x_ptr, res_ptr, nw_ptr, k0 + k_in_tile, k_hi, K, inv,
                                          GATED, NORM, HAS_RES), FORMAT)
    y = tl.sum(tl.sum(acc, 2), 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + split.to(tl.int64) * stride_os + n, y.to(out_ptr.dtype.element_ty),
             mask=nmask)


def choose_config(n: int, k: int, fmt: BlockFormat, sm_count: int) -> GemvConfig:
    """Two output rows a program, K tiles of 1024 elements, one warp: at or near the best
    of a sweep on the H200 at each of the 1B shape's projections (N 2048 to 128256), Q4_K
    and Q8_0 (block rows 1-8, tiles 512-2048, 1-4 warps; PERFORMANCE.md, 2026-12-04).
    Tiles of 2048 did as well there but made Q6_K spill registers at one warp (ptxas,
    sm_90a); K split where the rows alone leave SMs idle."""
    block_n = 2
    tile = min(1024, max(fmt.group_size, next_power_of_2(k)))
    blocks = triton.cdiv(n, block_n)
    splits = 1 if blocks >= 2 * sm_count else min(4, triton.cdiv(2 * sm_count, blocks),
                                                   max(1, k // 1024))
    return GemvConfig(block_n, tile // fmt.group_size, splits, 1)


def gemv(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
         config: GemvConfig | None = None, gated: bool = False) -> torch.Tensor:
    """``x [1, K] @ dequantize(weight).T (+ bias)`` as ``[1, N]`` in x's dtype, fp32
    accumulation; ``weight`` is ``uint8 [N, row_bytes]`` in ``fmt``. ``gated``: x is
    ``[1, 2K]`` (gate, up) and the input silu(gate) * up, saving the activation's kernel."""
    k = check_weight(weight, fmt)
    need = [1, 2 * k] if gated else [1, k]
    if list(x.shape) != need:
        raise ValueError(f"x must be {need}{' (gate, up)' if gated else ''} for a {fmt.name} "
                         f"weight of {k} columns; got {tuple(x.shape)}")
    check_linear(x[:, :k], weight, fmt, bias)  # its dtype and the bias
    return _launch(x, weight, fmt, bias, config, InputNorm(None, x, None, 0.0), gated)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
              eps: float, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
              config: GemvConfig | None = None):
    """``gemv(rms_norm(x + residual) * norm_weight)`` and ``x + residual`` (None without
    a residual), the norm computed as the GEMV reads its input, saving the norm's kernel."""
    k = check_linear(x, weight, fmt, bias)[0]
    if x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, {k}]; got {tuple(x.shape)}")
    x, norm = triton_gemv.input_norm(x, residual, norm_weight, eps, ValueError)
    return _launch(x, weight, fmt, bias, config, norm, False, normed=True), norm.total


def _launch(x, weight, fmt, bias, config, norm: InputNorm, gated: bool, normed=False):
    x, n, k = x.contiguous(), weight.shape[0], fmt.features(weight.shape[1])
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0 or k == 0:
        if norm.total is not None:
            norm.total.copy_(x + norm.residual)
        return out
    c = config or choose_config(n, k, fmt, triton_attention.sm_count(x.device))
    k_per_split, splits = split_k(k, c.groups * fmt.group_size, c.splits)
    part = out if splits == 1 else torch.empty((splits, 1, n), dtype=torch.float32,
                                               device=x.device)
    launch = pdl.launch_options(x.device)
    _gemv_kernel[(triton.cdiv(n, c.block_n), splits)](
        x, _or(norm.residual, x), norm.weight, _or(norm.total, x), weight,
        _or(bias, x), part, n, k, k_per_split, weight.stride(0),
        part.stride(0) if splits > 1 else 0, norm.eps, FORMAT=fmt.code,
        TYPE_SIZE=fmt.type_size, HAS_BIAS=bias is not None and splits == 1, GATED=gated,
        NORM=normed, HAS_RES=norm.residual is not None, BLOCK_N=c.block_n, GROUPS=c.groups,
        GROUP=fmt.group_size, num_warps=c.num_warps, **launch)
    if splits > 1:
        sum_splits(part, bias, out, launch)
    return out


def _or(tensor, placeholder):
    """A pointer argument the kernel does not read when ``tensor`` is None."""
    return placeholder if tensor is None else tensor


def sum_splits(part: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               launch: dict) -> None:
    """``out = sum of part's splits (+ bias)`` in a fixed order (deterministic): the
    split-K GEMV's reduction kernel, shared with ``triton_gguf_matmul``."""
    splits, m, n = part.shape
    block = min(1024, next_power_of_2(n))
    triton_gemv._reduce_kernel[(m, triton.cdiv(n, block))](
        part, bias if bias is not None else out, out, n, splits, part.stride(0),
        part.stride(1), out.stride(0), HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
        **launch)
