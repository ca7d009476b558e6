"""DeepSeek's grouped routing as one launch (``tokenspeed::group_top_k``; the reference is
``group_route_reference``).

As plain ops a decode step's grouped choice is some seventeen launches a mixture layer
(scores, group maxima or top-2 sums, a top-k of the groups, a scatter, an expand, a mask,
the top-k of the experts, a gather, the division), each a round trip for a few hundred
bytes. One program a row holds the row's scores (up to ``MAX_EXPERTS``) and a
``[groups, experts]`` membership grid, ranks the groups by one reduction along the grid,
and picks first the groups, then the experts, one reduction a pick, as
``triton_route._choose`` picks: keys hold a score's order in their high word and the
expert's rank in their low word, so the lowest group or expert comes first among equals.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.group_route_reference import check

MAX_EXPERTS = 1024   # one program holds a row's scores
MAX_GROUPS = 64      # and a [groups, experts] grid of them


class Grouping(NamedTuple):
    """A grouped choice's settings, as ``group_top_k`` takes them (``triton_route``'s gate)."""
    correction_bias: torch.Tensor | None
    n_group: int
    topk_group: int
    method: str


@triton.jit
def _keys(values, rank, taken):
    """int64 keys that order as the float32 ``values`` do, negative ones too (a negative
    float's magnitude bits flipped), with ``rank`` in the low word; ``taken``: the lowest."""
    bits = values.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(taken, _lowest(rank), (bits.to(tl.int64) << 32) | rank.to(tl.int64))


@triton.jit
def _lowest(rank):
    """The key of an entry taken or absent: below every value's."""
    return (tl.full(rank.shape, -2147483648, tl.int32).to(tl.int64) << 32) | rank.to(tl.int64)


@triton.jit
def _group_scores(choice, member, NOAUX: tl.constexpr):
    """``[groups]``: a group's best choice (V2), or the sum of its two best (V3: the best
    twice where it is there twice)."""
    grid = tl.where(member, choice[None, :], float("-inf"))
    best = tl.max(grid, 1)
    if NOAUX:
        top = member & (grid == best[:, None])
        second = tl.max(tl.where(top, float("-inf"), grid), 1)
        best = best + tl.where(tl.sum(top.to(tl.int32), 1) > 1, best, second)
    return best


@triton.jit
def choose_grouped(x, e, bias_ptr, weights_ptr, ids_ptr, num_experts, per_group, n_group, scale, K: tl.constexpr,
                   TOPK_GROUP: tl.constexpr, NOAUX: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row's choice from its float32 logits ``x [BLOCK_E]`` (``e``: the experts'
    indices, -inf past them) into ``weights_ptr[:K]`` and ``ids_ptr[:K]``, the largest
    choice first. Shared with ``triton_route``'s gate."""
    g, j = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_K)
    real = e < num_experts
    if NOAUX:
        scores = tl.sigmoid(x)
        choice = tl.where(real, scores + tl.load(bias_ptr + e, mask=real, other=0.0).to(tl.float32), float("-inf"))
    else:
        scores = tl.exp(x - tl.max(x, 0))
        scores = scores / tl.sum(tl.where(real, scores, 0.0), 0)
        choice = tl.where(real, scores, float("-inf"))
    member = ((e // per_group)[None, :] == g[:, None]) & real[None, :]
    group_keys = _keys(_group_scores(choice, member, NOAUX), BLOCK_G - 1 - g, g >= n_group)
    kept = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_keys, 0)
        kept = kept | (group_keys == best)
        group_keys = tl.where(group_keys == best, _lowest(BLOCK_G - 1 - g), group_keys)
    in_kept = tl.max(tl.where(member & kept[:, None], 1, 0), 0) > 0
    value = tl.where(in_kept, choice, float("-inf")) if NOAUX else tl.where(in_kept, scores, 0.0)
    keys = _keys(value, BLOCK_E - 1 - e, ~real)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for pick in tl.static_range(K):
        best = tl.max(keys, 0)
        expert = tl.minimum(BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32), num_experts - 1)   # a real one
        weights = tl.where(j == pick, tl.sum(tl.where(e == expert, scores, 0.0), 0), weights)
        ids = tl.where(j == pick, expert, ids)
        keys = tl.where(keys == best, _lowest(BLOCK_E - 1 - e), keys)
    if NORMALIZE:
        weights = weights / (tl.sum(tl.where(j < K, weights, 0.0), 0) + 1e-20)
    tl.store(weights_ptr + j, weights * scale, mask=j < K)
    tl.store(ids_ptr + j, ids.to(tl.int64), mask=j < K)


@triton.jit
def _group_top_k_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, per_group, n_group, stride_l,
                        scale, K: tl.constexpr, TOPK_GROUP: tl.constexpr, NOAUX: tl.constexpr,
                        NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    choose_grouped(x, e, bias_ptr, weights_ptr + t * K, ids_ptr + t * K, num_experts, per_group, n_group, scale, K,
                   TOPK_GROUP, NOAUX, NORMALIZE, BLOCK_E, BLOCK_G, BLOCK_K)


def group_top_k(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int, n_group: int, topk_group: int,
                method: str, normalize: bool, scale: float) -> list[torch.Tensor]:
    """``logits [T, E]`` (float32) -> ``[weights [T, k] float32, ids [T, k] int64]``, the
    largest choice first."""
    check(tuple(logits.shape), correction_bias, k, n_group, topk_group, method)
    rows, experts = logits.shape
    weights = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        noaux = method == "noaux_tc"
        bias = correction_bias.contiguous() if noaux else logits   # unread without NOAUX
        _group_top_k_kernel[(rows,)](logits, bias, weights, ids, experts, experts // n_group, n_group,
                                     logits.stride(0), float(scale), K=k, TOPK_GROUP=topk_group, NOAUX=noaux,
                                     NORMALIZE=normalize, BLOCK_E=next_power_of_2(experts),
                                     BLOCK_G=next_power_of_2(n_group), BLOCK_K=next_power_of_2(k), num_warps=4,
                                     **pdl.launch_options(logits.device))
    return [weights, ids]


def fits(experts: int, n_group: int) -> bool:
    """Whether one program holds a row's scores and groups."""
    return experts <= MAX_EXPERTS and n_group <= MAX_GROUPS
