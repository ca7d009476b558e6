"""Row gather with dequantization: an embedding table kept in its GGUF blocks gives the
rows of the step's tokens, decoded as they are copied out.

A program decodes one K tile of one token's row; the table itself is never widened, so a
quantized table costs its blocks in memory, and a tied output head reads the same bytes
through the matmul kernels. ``dequantize`` is the same gather over every row.
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.gguf_blocks import BlockFormat, check_weight
from tokenspeed.backends.kernels.triton_gguf_dequant import reads_words, weight_tile

TILE = 1024


@triton.jit
def _embedding_kernel(ids_ptr, w_ptr, out_ptr, K, vocab, stride_wn, stride_out,
                      FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr, GROUPS: tl.constexpr,
                      GROUP: tl.constexpr, WORDS: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)  # the ids are the step's, written by the kernel before
    token = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GROUPS
    row = tl.load(ids_ptr + token + tl.arange(0, 1))
    values = weight_tile(w_ptr, row, (row >= 0) & (row < vocab), g0, K // GROUP, stride_wn,
                         FORMAT, TYPE_SIZE, 1, GROUPS, GROUP, WORDS)
    k = g0 * GROUP + tl.arange(0, GROUPS * GROUP)
    tl.store(out_ptr + token * stride_out + k[None, :],
             values.to(out_ptr.dtype.element_ty), mask=(k < K)[None, :])


def embedding(ids: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat,
              dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(weight)[ids]`` as ``[T, K]`` in ``dtype``; ``ids`` int32 or int64
    ``[T]``, ``weight`` ``uint8 [vocab, row_bytes]``. Token ids are checked where requests
    enter (checking them here would cost a sync); the kernel masks an id outside the table
    (its row reads as zeros) rather than read out of bounds."""
    k = check_weight(weight, fmt)
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64 [T]; got {ids.dtype} {tuple(ids.shape)}")
    out = torch.empty((ids.shape[0], k), dtype=dtype, device=weight.device)
    if ids.shape[0] == 0 or k == 0:
        return out
    groups = min(TILE, triton.next_power_of_2(k)) // fmt.group_size
    grid = (ids.shape[0], triton.cdiv(k, groups * fmt.group_size))
    _embedding_kernel[grid](
        ids.contiguous(), weight, out, k, weight.shape[0], weight.stride(0), out.stride(0),
        FORMAT=fmt.code, TYPE_SIZE=fmt.type_size, GROUPS=groups, GROUP=fmt.group_size,
        WORDS=reads_words(weight, fmt), num_warps=4, **pdl.launch_options(weight.device))
    return out


def dequantize(weight: torch.Tensor, fmt: BlockFormat, dtype: torch.dtype) -> torch.Tensor:
    """The whole table, ``[N, K]`` in ``dtype``."""
    rows = torch.arange(weight.shape[0], device=weight.device)
    return embedding(rows, weight, fmt, dtype)
