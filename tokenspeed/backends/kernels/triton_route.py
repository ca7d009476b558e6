"""A router's softmax and top-k as one launch (``tokenspeed::softmax_top_k``; the reference
is ``reference.softmax_top_k``), and with the gate's product before it (``tokenspeed::route``).

At small batches a mixture-of-experts layer's routing is a handful of tiny kernels
(softmax, top-k, the sum and division that renormalise, the scaling), each a launch and a
round trip to memory for a few hundred bytes. One program a row holds the row's logits
(every expert, up to a few hundred), takes the softmax in float32 and picks the k largest
one after another, the lowest expert first among equals.

``route`` computes the logits too, for a decode step of up to ``ROUTE_MAX_ROWS`` rows: each
program multiplies a tile of the gate (``GATE_BLOCK_N`` experts by ``GATE_BLOCK_K`` features)
by every row's features once, in float32, and stores its partial sums; the last program to
finish (counted in, as ``triton_gemv``'s split reductions are) adds the partials of each
row, rounds them as the gate's output is rounded, and chooses. DeepSeek's gate, a float32
product of the layer's 16-bit input, took a cast, a cuBLAS product and this kernel before.
``norm_route`` normalises the gate's input in the same launch (``rms_norm(x + residual)``,
which every program computes for its slice of the features) and stores the normed rows and
their sum, which the mixture and the next layer read: the norm's own launch is gone. A
DeepSeek router's grouped choice takes the last program's place of the softmax's
(``triton_group_route.choose_grouped``).
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl, triton_gemv, triton_group_route
from tokenspeed.backends.kernels.group_route_reference import check as check_grouped
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError

MAX_EXPERTS = 1024   # one program holds a row's logits
ROUTE_MAX_ROWS = 16  # rows ``route`` takes in one launch: a decode step's
GATE_BLOCK_N, GATE_BLOCK_K = 8, 256   # a program's tile of the gate, kept in registers across the rows
NORM_TILE = 4096   # features of a row read at once for ``norm_route``'s statistics


@triton.jit
def _choose(x, e, j, num_experts, weights_ptr, ids_ptr, scale, K: tl.constexpr, NORMALIZE: tl.constexpr,
            BLOCK_E: tl.constexpr):
    """One row's choice from its float32 logits ``x [BLOCK_E]`` (-inf past the experts).
    A pick is one reduction, of keys that hold a probability's bits above the expert's
    rank: non-negative floats order as their bits do, and the lower expert of two equal
    probabilities holds the higher rank. (Two reductions a pick, the largest and then its
    lowest expert, were most of the launch's serial tail.)"""
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(e < num_experts, p / tl.sum(p, 0), -1.0)   # negative keys: no padding expert is ever picked
    rank = (BLOCK_E - 1 - e).to(tl.int64)
    keys = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | rank
    weights = tl.zeros(j.shape, dtype=tl.float32)
    ids = tl.zeros(j.shape, dtype=tl.int32)
    for pick in tl.static_range(K):
        best = tl.max(keys, 0)
        expert = tl.minimum(BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32), num_experts - 1)   # a real one
        weights = tl.where(j == pick, (best >> 32).to(tl.int32).to(tl.float32, bitcast=True), weights)
        ids = tl.where(j == pick, expert, ids)
        keys = tl.where(rank == (best & (BLOCK_E - 1)), -(1 << 62), keys)
    if NORMALIZE:
        weights = weights / tl.sum(tl.where(j < K, weights, 0.0), 0)
    tl.store(weights_ptr + j, weights * scale, mask=j < K)
    tl.store(ids_ptr + j, ids.to(tl.int64), mask=j < K)


@triton.jit
def _softmax_top_k_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, scale, K: tl.constexpr,
                          NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e, j = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    _choose(x, e, j, num_experts, weights_ptr + t * K, ids_ptr + t * K, scale, K, NORMALIZE, BLOCK_E)


@triton.jit
def _normed_slice(x_row, res_row, nw_ptr, normed_row, total_row, k, hidden, eps, written,
                  HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr):
    """A row's ``rms_norm(x + residual)`` at features ``k``, in float32 (rounded as
    ``add_rms_norm`` rounds it): every program reads the whole row for its statistics (a
    few kilobytes, in L2; in one tile of ``BLOCK_H`` up to ``NORM_TILE`` features, so one
    round trip), and stores its slice of the normed row and of the sum, for the ops after
    the router, below feature ``written`` (the row's width, or 0)."""
    squares = tl.zeros([BLOCK_H], tl.float32)
    for k0 in range(0, hidden, BLOCK_H):
        tile = k0 + tl.arange(0, BLOCK_H)
        h = triton_gemv._hidden(x_row, res_row, tile, tile < hidden, HAS_RES)
        squares += h * h
    inv = 1.0 / tl.sqrt(tl.sum(squares, 0) / hidden + eps)
    mask = k < hidden
    h = triton_gemv._hidden(x_row, res_row, k, mask, HAS_RES)
    normed = triton_gemv.normed(h, tl.load(nw_ptr + k, mask=mask, other=0.0), inv, x_row.dtype.element_ty)
    tl.store(normed_row + k, normed, mask=k < written)
    if HAS_RES:
        tl.store(total_row + k, h.to(total_row.dtype.element_ty), mask=k < written)
    return normed.to(tl.float32)


@triton.jit
def _route_kernel(x_ptr, w_ptr, part_ptr, weights_ptr, ids_ptr, cnt_ptr, rows, num_experts, hidden, stride_xm,
                  stride_wn, scale, res_ptr, nw_ptr, normed_ptr, total_ptr, eps, bias_ptr, per_group, n_group,
                  K: tl.constexpr, NORMALIZE: tl.constexpr, ROUND: tl.constexpr, NORM: tl.constexpr,
                  HAS_RES: tl.constexpr, GROUPED: tl.constexpr, TOPK_GROUP: tl.constexpr, NOAUX: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                  BLOCK_TOP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (column block, split): the gate's tile is read before the wait (PDL), then
    each row's partial ``[BLOCK_N]`` is stored at ``part[split, row]``. ROUND: the logits
    are rounded to x's dtype (the gate's output dtype) before the softmax. NORM: the gate
    reads ``rms_norm(x + residual)`` (``res_ptr`` read if HAS_RES), which the first column
    block's programs store, with the sum, as ``[rows, hidden]`` rows (x's rows are
    ``stride_xm`` apart, the residual's contiguous). GROUPED: the last program chooses as
    ``triton_group_route`` does (``bias_ptr`` read if NOAUX), not by the softmax's top k."""
    pdl.start(USE_PDL)
    split = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = split * BLOCK_K + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                mask=(n < num_experts)[:, None] & (k < hidden)[None, :], other=0.0).to(tl.float32)
    pdl.wait(USE_PDL)
    written = tl.where(tl.program_id(0) == 0, hidden, 0)   # the first column block stores the norm's rows
    for m in range(0, rows):
        if NORM:
            x = _normed_slice(x_ptr + m * stride_xm, res_ptr + m * hidden, nw_ptr, normed_ptr + m * hidden,
                              total_ptr + m * hidden, k, hidden, eps, written, HAS_RES, BLOCK_H)
        else:
            x = tl.load(x_ptr + m * stride_xm + k, mask=k < hidden, other=0.0).to(tl.float32)
        tl.store(part_ptr + (split * rows + m) * num_experts + n, tl.sum(w * x[None, :], 1), mask=n < num_experts)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) * tl.num_programs(1) - 1:
        s, e, j = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_TOP)
        mask = (s < tl.num_programs(1))[:, None] & (e < num_experts)[None, :]
        for m in range(0, rows):
            parts = tl.load(part_ptr + (s[:, None] * rows + m) * num_experts + e[None, :], mask=mask, other=0.0,
                            cache_modifier=".cg")
            logits = tl.sum(parts, 0)
            if ROUND:
                logits = logits.to(x_ptr.dtype.element_ty).to(tl.float32)
            logits = tl.where(e < num_experts, logits, float("-inf"))
            if GROUPED:
                triton_group_route.choose_grouped(logits, e, bias_ptr, weights_ptr + m * K, ids_ptr + m * K,
                                                  num_experts, per_group, n_group, scale, K, TOPK_GROUP, NOAUX,
                                                  NORMALIZE, BLOCK_E, BLOCK_G, BLOCK_TOP)
            else:
                _choose(logits, e, j, num_experts, weights_ptr + m * K, ids_ptr + m * K, scale, K, NORMALIZE, BLOCK_E)
        tl.store(cnt_ptr, 0)


def softmax_top_k(logits: torch.Tensor, k: int, normalize: bool, scale: float) -> list[torch.Tensor]:
    """``logits [T, E]`` -> ``[weights [T, k] float32, ids [T, k] int64]``."""
    _check_choice(logits.shape, k)
    rows, experts = logits.shape
    weights, ids = _choice(rows, k, logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _softmax_top_k_kernel[(rows,)](logits, weights, ids, experts, logits.stride(0), float(scale), K=k,
                                       NORMALIZE=normalize, BLOCK_E=next_power_of_2(experts),
                                       BLOCK_K=next_power_of_2(k), num_warps=4, **pdl.launch_options(logits.device))
    return [weights, ids]


class RouterNorm(NamedTuple):
    """The RMSNorm ``norm_route`` applies to the router's input, and where its outputs go."""
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    normed: torch.Tensor
    total: torch.Tensor | None


def route(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool, scale: float,
          logits_dtype: torch.dtype | None, split_counters: torch.Tensor,
          grouping: "triton_group_route.Grouping | None" = None) -> list[torch.Tensor]:
    """``softmax_top_k(x [T, H] @ weight [E, H].T)`` for T <= ``ROUTE_MAX_ROWS``, in one launch
    that leaves its counter (``split_counters[0]``, int32) zeroed; given a ``grouping``,
    ``group_top_k`` of the logits instead. ``logits_dtype``: float32, or None for x's dtype
    (the logits rounded to it)."""
    return _route(x, weight, k, normalize, scale, logits_dtype, split_counters, None, grouping)


def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               weight: torch.Tensor, k: int, normalize: bool, scale: float, logits_dtype: torch.dtype | None,
               split_counters: torch.Tensor, grouping: "triton_group_route.Grouping | None" = None
               ) -> list[torch.Tensor]:
    """``route`` of ``rms_norm(x + residual)`` in the same one launch: ``[weights, ids,
    normed, x + residual]`` (no sum without a residual)."""
    if (residual is not None and residual.shape != x.shape) or norm_weight.shape != x.shape[-1:]:
        raise InternalError(f"norm_route wants a residual shaped as x {tuple(x.shape)} and a norm weight of "
                            f"its width; got {None if residual is None else tuple(residual.shape)} and "
                            f"{tuple(norm_weight.shape)}")
    normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    total = None if residual is None else torch.empty_like(normed)
    norm = RouterNorm(None if residual is None else residual.contiguous(), norm_weight.contiguous(), eps, normed,
                      total)
    return [*_route(x, weight, k, normalize, scale, logits_dtype, split_counters, norm, grouping), normed,
            *([] if total is None else [total])]


def _route(x, weight, k: int, normalize: bool, scale: float, logits_dtype, split_counters,
           norm: RouterNorm | None, grouping) -> list[torch.Tensor]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] > ROUTE_MAX_ROWS:
        raise InternalError(f"route wants x [T, H] with T <= {ROUTE_MAX_ROWS} and weight [E, H]; got "
                            f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if logits_dtype not in (None, torch.float32) or split_counters.dtype != torch.int32:
        raise InternalError(f"route takes float32 or x's dtype for its logits and int32 counters; got "
                            f"{logits_dtype} and {split_counters.dtype}")
    (rows, hidden), experts = x.shape, weight.shape[0]
    group = grouping or triton_group_route.Grouping(None, 1, 1, "greedy")
    if grouping is None:
        _check_choice((rows, experts), k)
    else:
        check_grouped((rows, experts), group.correction_bias, k, group.n_group, group.topk_group, group.method)
    weights, ids = _choice(rows, k, x.device)
    if rows:
        x = x if x.stride(-1) == 1 else x.contiguous()
        weight = weight if weight.stride(-1) == 1 else weight.contiguous()
        grid = (triton.cdiv(experts, GATE_BLOCK_N), triton.cdiv(hidden, GATE_BLOCK_K))
        part = torch.empty((grid[1], rows, experts), dtype=torch.float32, device=x.device)
        n = norm or RouterNorm(None, x, 0.0, x, None)   # unread without NORM
        noaux = group.method == "noaux_tc"
        _route_kernel[grid](x, weight, part, weights, ids, split_counters, rows, experts, hidden, x.stride(0),
                            weight.stride(0), float(scale), triton_gemv._or(n.residual, x), n.weight, n.normed,
                            triton_gemv._or(n.total, x), float(n.eps),
                            group.correction_bias.contiguous() if noaux else x, experts // group.n_group,
                            group.n_group, K=k, NORMALIZE=normalize,
                            ROUND=logits_dtype is None and x.dtype != torch.float32, NORM=norm is not None,
                            HAS_RES=n.residual is not None, GROUPED=grouping is not None, TOPK_GROUP=group.topk_group,
                            NOAUX=noaux, BLOCK_N=GATE_BLOCK_N, BLOCK_K=GATE_BLOCK_K,
                            BLOCK_E=next_power_of_2(experts), BLOCK_S=next_power_of_2(grid[1]),
                            BLOCK_TOP=next_power_of_2(k), BLOCK_H=min(next_power_of_2(hidden), NORM_TILE),
                            BLOCK_G=next_power_of_2(group.n_group), num_warps=4, **pdl.launch_options(x.device))
    return [weights, ids]


def _check_choice(shape, k: int) -> None:
    if len(shape) != 2 or not 0 < k <= shape[1] or shape[1] > MAX_EXPERTS:
        raise InternalError(f"softmax_top_k wants logits [T, E] with 0 < k <= E <= {MAX_EXPERTS}; got "
                            f"{tuple(shape)} and k={k}")


def _choice(rows: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty((rows, k), dtype=torch.float32, device=device),
            torch.empty((rows, k), dtype=torch.int64, device=device))
