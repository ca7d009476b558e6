"""A router's softmax and top-k as one launch (``tokenspeed::softmax_top_k``; the reference
is ``reference.softmax_top_k``).

At small batches a mixture-of-experts layer's routing is a handful of tiny kernels
(softmax, top-k, the sum and division that renormalise, the scaling), each a launch and a
round trip to memory for a few hundred bytes. One program a row holds the row's logits
(every expert, up to a few hundred), takes the softmax in float32 and picks the k largest
one after another, the lowest expert first among equals.
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError

MAX_EXPERTS = 1024   # one program holds a row's logits


@triton.jit
def _softmax_top_k_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, scale, K: tl.constexpr,
                          NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e, j = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(e < num_experts, p / tl.sum(p, 0), -1.0)   # no padding expert is ever picked
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for pick in tl.static_range(K):
        best = tl.max(p, 0)
        expert = tl.minimum(tl.min(tl.where(p == best, e, BLOCK_E), 0), num_experts - 1)   # NaN: in range
        weights = tl.where(j == pick, best, weights)
        ids = tl.where(j == pick, expert, ids)
        p = tl.where(e == expert, -1.0, p)
    if NORMALIZE:
        weights = weights / tl.sum(tl.where(j < K, weights, 0.0), 0)
    tl.store(weights_ptr + t * K + j, weights * scale, mask=j < K)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=j < K)


def softmax_top_k(logits: torch.Tensor, k: int, normalize: bool, scale: float) -> list[torch.Tensor]:
    """``logits [T, E]`` -> ``[weights [T, k] float32, ids [T, k] int64]``."""
    if logits.dim() != 2 or not 0 < k <= logits.shape[1] or logits.shape[1] > MAX_EXPERTS:
        raise InternalError(f"softmax_top_k wants logits [T, E] with 0 < k <= E <= {MAX_EXPERTS}; got "
                            f"{tuple(logits.shape)} and k={k}")
    rows, experts = logits.shape
    weights = torch.empty((rows, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((rows, k), dtype=torch.int64, device=logits.device)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        _softmax_top_k_kernel[(rows,)](logits, weights, ids, experts, logits.stride(0), float(scale), K=k,
                                       NORMALIZE=normalize, BLOCK_E=next_power_of_2(experts),
                                       BLOCK_K=next_power_of_2(k), num_warps=4, **pdl.launch_options(logits.device))
    return [weights, ids]
