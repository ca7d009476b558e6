"""Split-K skinny GEMM (GEMV) for decode: ``linear(x [M, K], weight [N, K]) -> [M, N]``.

At batch 1..16 a linear layer only streams its weight, so speed is bandwidth: this kernel
keeps every SM busy by splitting K when N alone gives too few column blocks, accumulates in
fp32, and reduces the split partials in a fixed order in a second pass (deterministic, no
atomics on the values). Given ``split_counters`` (zeroed int32, kept between launches), the
last split of each column block to finish does that reduction in the same launch, in the
same order, so the output is the same to the bit and the second launch is gone. For M == 1
it accumulates products elementwise (no tensor-core padding); for M > 1 it pads M to 16 and
uses ``tl.dot``. Nothing is read on the host and buffers are allocated per call, so it can
be captured in a CUDA graph.

The input may be computed as it is read, which saves the kernel that would produce it:
silu(gate) * up (``gated``) or rms_norm(x + residual) * weight (``norm_linear``). Under
PDL the first weight tile is requested before the kernel waits for its predecessor.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_attention
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError

MAX_M = 16
NORM_TILE = 4096


class InputNorm(NamedTuple):
    """The RMSNorm ``norm_linear`` applies to its input, and where the sum goes."""
    residual: torch.Tensor | None
    weight: torch.Tensor
    total: torch.Tensor | None
    eps: float


@triton.jit
def _hidden(x_ptr, res_ptr, offs, mask, HAS_RES: tl.constexpr):
    """x (+ residual, the sum rounded to x's dtype as ``add_rms_norm`` rounds it), fp32."""
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    return h


@triton.jit
def _inv_rms(x_ptr, res_ptr, total_ptr, m, mmask, K, stride_xm, eps, write_rows,
             HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per-row 1/rms over the whole of K (every program reads the rows: they are short and
    in L2); the first ``write_rows`` rows of the sum are written (by one program only)."""
    kk = tl.arange(0, BLOCK_K)
    squares = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        mask = mmask[:, None] & (k < K)[None, :]
        offs = m[:, None] * stride_xm + k[None, :]
        h = _hidden(x_ptr, res_ptr, offs, mask, HAS_RES)
        if HAS_RES:
            tl.store(total_ptr + offs, h.to(total_ptr.dtype.element_ty),
                     mask=mask & (m < write_rows)[:, None])
        squares += tl.sum(h * h, 1)
    return 1.0 / tl.sqrt(squares / K + eps)


@triton.jit
def _normed_tile(x_ptr, res_ptr, nw_ptr, total_ptr, m, mmask, k, K, stride_xm, eps,
                 write_rows, HAS_RES: tl.constexpr):
    """rms_norm(x + residual) * norm weight of rows no longer than the tile, from one read
    of them; rounded as ``_input`` rounds it. The first ``write_rows`` rows of the sum are
    written."""
    mask = mmask[:, None] & (k < K)[None, :]
    offs = m[:, None] * stride_xm + k[None, :]
    nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    h = _hidden(x_ptr, res_ptr, offs, mask, HAS_RES)
    if HAS_RES:
        tl.store(total_ptr + offs, h.to(total_ptr.dtype.element_ty),
                 mask=mask & (m < write_rows)[:, None])
    inv = 1.0 / tl.sqrt(tl.sum(h * h, 1) / K + eps)
    ty = x_ptr.dtype.element_ty
    return (nw[None, :] * (h * inv[:, None]).to(ty).to(tl.float32)).to(ty)


@triton.jit
def _input(x_ptr, res_ptr, nw_ptr, offs, k, mask, K, inv, GATED: tl.constexpr,
           NORM: tl.constexpr, HAS_RES: tl.constexpr):
    """An input tile ``[BLOCK_M, BLOCK_K]`` in x's dtype: x itself; GATED, silu(gate) * up
    of a ``[M, 2K]`` gate_up row; NORM, rms_norm(x + residual) * norm weight given the
    rows' ``inv`` rms. Each is rounded as the unfused kernel rounds it."""
    ty = x_ptr.dtype.element_ty
    if GATED:  # one return per function: Triton compiles what follows a return too
        x = silu_mul(tl.load(x_ptr + offs, mask=mask, other=0.0), tl.load(x_ptr + offs + K, mask=mask, other=0.0),
                     ty)
    elif NORM:
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0)
        x = normed(_hidden(x_ptr, res_ptr, offs, mask, HAS_RES), nw[None, :], inv[:, None], ty)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def silu_mul(gate, up, ty):
    """silu(gate) * up in ``ty``, the activation rounded to ``ty`` first (as the unfused
    ``silu_and_mul`` rounds it); elementwise, any shape."""
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(ty).to(tl.float32)
    return (act * up.to(tl.float32)).to(ty)


@triton.jit
def normed(h, nw, inv, ty):
    """rms_norm's output in ``ty`` from the fp32 hidden values, the norm weight and 1/rms
    (broadcast to h's shape), rounded as ``rms_norm`` rounds it."""
    return (nw.to(tl.float32) * (h * inv).to(ty).to(tl.float32)).to(ty)


@triton.jit
def _weight_tile(w_tile, k0, k_hi, kk, nmask, BLOCK_M: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` for the one-row path, ``[BLOCK_K, BLOCK_N]`` for ``tl.dot``."""
    kmask = (k0 + kk) < k_hi
    if BLOCK_M == 1:
        w = tl.load(w_tile + k0, mask=nmask[:, None] & kmask[None, :], other=0.0)
    else:
        w = tl.load(w_tile + k0, mask=nmask[None, :] & kmask[:, None], other=0.0)
    return w


@triton.jit
def _accumulate(acc, w, x, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr):
    """One row: elementwise products (no tensor-core padding); several rows: ``tl.dot``."""
    if BLOCK_M == 1:
        acc = acc + w.to(tl.float32) * x.to(tl.float32)
    else:
        acc = tl.dot(x.to(w.dtype), w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, res_ptr, nw_ptr, total_ptr, w_ptr, bias_ptr, out_ptr, M, N, K,
                 k_per_split, stride_xm, stride_wn, stride_os, stride_om, eps,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORM: tl.constexpr,
                 HAS_RES: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 USE_PDL: tl.constexpr, fin_ptr, cnt_ptr, stride_fm, MERGE: tl.constexpr,
                 MERGE_BIAS: tl.constexpr):
    """The first weight tile is requested before waiting on the previous kernel (PDL).
    ONE_TILE: a normed input whose whole row is that tile. MERGE: ``out_ptr`` holds the
    splits' partials, and the last split of the column block reduces them into ``fin_ptr``
    (``_reduce_last``), adding the bias if MERGE_BIAS."""
    pdl.start(USE_PDL)
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    m = tl.arange(0, BLOCK_M)
    mmask = m < M
    kk = tl.arange(0, BLOCK_K)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if BLOCK_M == 1:
        w_tile = w_ptr + n[:, None].to(tl.int64) * stride_wn + kk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    else:
        w_tile = w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w = _weight_tile(w_tile, k_lo, k_hi, kk, nmask, BLOCK_M)
    pdl.wait(USE_PDL)
    inv = tl.zeros([BLOCK_M], tl.float32)
    write_rows = tl.where((tl.program_id(0) == 0) & (split == 0), M, 0)  # the sum, once
    if ONE_TILE:  # the row's only tile gives its statistics and the product: read once
        x = _normed_tile(x_ptr, res_ptr, nw_ptr, total_ptr, m, mmask, kk, K, stride_xm, eps,
                         write_rows, HAS_RES)
    else:
        if NORM:
            inv = _inv_rms(x_ptr, res_ptr, total_ptr, m, mmask, K, stride_xm, eps,
                           write_rows, HAS_RES, BLOCK_M, BLOCK_K)
        k = k_lo + kk
        x = _input(x_ptr, res_ptr, nw_ptr, m[:, None] * stride_xm + k[None, :], k,
                   mmask[:, None] & (k < k_hi)[None, :], K, inv, GATED, NORM, HAS_RES)
    acc = _accumulate(acc, w, x, BLOCK_M, PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):  # the first tile, peeled, came early
        k = k0 + kk
        x = _input(x_ptr, res_ptr, nw_ptr, m[:, None] * stride_xm + k[None, :], k,
                   mmask[:, None] & (k < k_hi)[None, :], K, inv, GATED, NORM, HAS_RES)
        acc = _accumulate(acc, _weight_tile(w_tile, k0, k_hi, kk, nmask, BLOCK_M), x,
                          BLOCK_M, PRECISION)
    if BLOCK_M == 1:
        acc = tl.sum(acc, 1)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + split.to(tl.int64) * stride_os + m[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])
    if MERGE:
        _reduce_last(out_ptr + m[:, None] * stride_om + n[None, :], stride_os, fin_ptr + m[:, None] * stride_fm
                     + n[None, :], bias_ptr + n, mmask[:, None] & nmask[None, :], nmask,
                     cnt_ptr + tl.program_id(0), MERGE_BIAS)


@triton.jit
def _reduce_last(parts, stride_os, final, bias, mask, nmask, counter, HAS_BIAS: tl.constexpr):
    """``_reduce_kernel``'s sum for this column block, by the split that counts itself in
    last (a barrier, then an acquire-release add: it sees every split's partial, read
    through L2), which then zeroes the counter for the next launch."""
    tl.debug_barrier()
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) - 1:
        acc = tl.zeros(mask.shape, tl.float32)
        for s in range(0, tl.num_programs(1)):
            acc += tl.load(parts + s * stride_os, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            acc += tl.load(bias, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(final, acc.to(final.dtype.element_ty), mask=mask)
        tl.store(counter, 0)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, out_ptr, N, splits, stride_ps, stride_pm, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_config(m: int, n: int, k: int, sm_count: int, normed: bool = False):
    """(block_n, block_k, splits, num_warps, num_stages), from sweeps on an H200 (bf16) of
    chains of launches under PDL (``benchmarks/tune_gemv.py``) and, for one row, of a
    decode layer's kernels in the order the step runs them (``benchmarks/layer_chain.py``).

    One row: thin column blocks and long K tiles keep many loads in flight per program; a
    ``normed`` row of up to ``NORM_TILE`` is one tile, read once for its statistics and its
    product, and fewer column blocks re-read it less; 8 warps serve a tile of 8192 or more.
    Several rows: ``tl.dot`` tiles of 32-64 columns. K is split only when the column blocks
    alone leave SMs idle, since the reduction is a second launch."""
    if m == 1:
        if normed and k <= NORM_TILE:
            block_n, block_k = (16 if n < 2048 else 4), next_power_of_2(k)
            return block_n, block_k, 1, (8 if block_n * block_k >= 8192 else 4), 1
        block_n, block_k, warps = (8, 2048, 8) if k >= 4096 else (2 if n <= 4096 else 4, 1024, 4)
        n_blocks = triton.cdiv(n, block_n)
        splits = 1
        if n_blocks < sm_count:  # e.g. the 0.5B down projection (docs/PERFORMANCE.md)
            splits, block_k = min(4, triton.cdiv(2 * sm_count, n_blocks)), 1024
        stages = 3
    else:
        block_n, block_k, warps = (64 if n >= 2048 else 32), 128, 4
        n_blocks = triton.cdiv(n, block_n)
        stages = 3 if n_blocks > 8 * sm_count else 5
        splits = min(4, triton.cdiv(2 * sm_count, n_blocks), max(1, k // 512)) \
            if n_blocks < sm_count else 1
    return block_n, block_k, max(1, min(splits, triton.cdiv(k, block_k))), warps, stages


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor = None,
           config=None, gated: bool = False, split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T (+ bias) for M <= 16, fp32 accumulation, output x.dtype.

    ``gated``: x is ``[M, 2K]`` (gate, up) and the input is silu(gate) * up, which saves
    the MLP's activation kernel. ``config`` overrides ``choose_config`` (for tuning).
    ``split_counters``: a split K reduced in the same launch (one counter a column block).
    """
    k = weight.shape[1] if weight.dim() == 2 else -1
    if x.dim() != 2 or k < 0 or x.shape[1] != (2 * k if gated else k):
        need = "[M, 2K] (gate, up)" if gated else "[M, K]"
        raise InternalError(f"x must be {need} and weight [N, K]; got {tuple(x.shape)} and "
                            f"{tuple(weight.shape)}")
    return _launch(x, weight, bias, config, gated=gated, split_counters=split_counters)


def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor = None, config=None,
                split_counters: torch.Tensor | None = None):
    """``linear(rms_norm(x + residual) * norm_weight)`` and ``x + residual``: the norm that
    feeds a projection computed as its GEMV reads the input, saving the norm's kernel.
    Returns (out, sum); the sum is None without a residual."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise InternalError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)} and "
                            f"{tuple(weight.shape)}")
    x, norm = input_norm(x, residual, norm_weight, eps, InternalError)
    return _launch(x, weight, bias, config, norm=norm, split_counters=split_counters), norm.total


def input_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               error: type[Exception]) -> tuple[torch.Tensor, InputNorm]:
    """``x`` contiguous and the ``InputNorm`` a GEMV reads it through (the sum's buffer made
    when there is a residual), once ``norm_weight`` and ``residual`` fit ``x [1, K]``; a
    misfit raises ``error`` (the GGUF GEMV's callers get a ``ValueError``)."""
    if norm_weight.shape != (x.shape[1],):
        raise error(f"norm weight must be [{x.shape[1]}]; got {tuple(norm_weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise error(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    x = x.contiguous()
    total = torch.empty_like(x) if residual is not None else None
    return x, InputNorm(residual.contiguous() if residual is not None else None,
                        norm_weight.contiguous(), total, eps)


def _launch(x, weight, bias, config, gated: bool = False, norm: InputNorm | None = None,
            split_counters: torch.Tensor | None = None):
    m, k, n = x.shape[0], weight.shape[1], weight.shape[0]
    if m > MAX_M:
        raise InternalError(f"M {m} must be <= {MAX_M}; use torch.nn.functional.linear")
    if bias is not None and bias.shape != (n,):
        raise InternalError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        if norm is not None and norm.total is not None:
            norm.total.copy_(x + norm.residual)
        return out
    block_n, block_k, splits, warps, stages = config or choose_config(
        m, n, k, triton_attention.sm_count(x.device), normed=norm is not None)
    k_per_split, splits = split_k(k, block_k, splits)
    merge = split_counters is not None and splits > 1
    if merge and (split_counters.dtype != torch.int32 or split_counters.numel() < triton.cdiv(n, block_n)):
        raise InternalError(f"split_counters must be int32, one per column block ({triton.cdiv(n, block_n)}); "
                            f"got {split_counters.dtype} [{split_counters.numel()}]")
    part = out if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32,
                                               device=x.device)
    has_bias = bias is not None and splits == 1
    has_norm, norm = norm is not None, norm or InputNorm(None, x, None, 0.0)  # unread if off
    launch = pdl.launch_options(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), splits)](
        x, _or(norm.residual, x), norm.weight, _or(norm.total, x), weight,
        _or(bias, x), part, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        part.stride(0) if splits > 1 else 0, part.stride(-2), norm.eps, HAS_BIAS=has_bias,
        GATED=gated, NORM=has_norm, HAS_RES=norm.residual is not None,
        ONE_TILE=has_norm and splits == 1 and k <= block_k, BLOCK_M=1 if m == 1 else MAX_M,
        BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        fin_ptr=out, cnt_ptr=split_counters if merge else x, stride_fm=out.stride(0), MERGE=merge,
        MERGE_BIAS=merge and bias is not None, num_warps=warps, num_stages=stages, **launch)
    if splits > 1 and not merge:
        block = min(1024, next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, block))](
            part, bias if bias is not None else x, out, n, splits, part.stride(0),
            part.stride(1), out.stride(0), HAS_BIAS=bias is not None, BLOCK=block,
            num_warps=4, **launch)
    return out


def split_k(k: int, block_k: int, splits: int) -> tuple[int, int]:
    """(K per split, splits) a launch runs: whole tiles per split, so ``splits`` may shrink."""
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    return k_per_split, triton.cdiv(k, k_per_split) if k else 1


def _or(tensor, placeholder):
    """A pointer argument the kernel does not read when ``tensor`` is None."""
    return placeholder if tensor is None else tensor
