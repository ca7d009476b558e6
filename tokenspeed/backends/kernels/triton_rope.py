"""A rotary embedding as one launch (``tokenspeed::rope``; the reference is ``reference.rope``).

A model whose rotary the pipeline cannot fold into a cache write (DeepSeek's latent
attention rotates the rope parts of its queries and keys on their own) otherwise runs it
as a dozen small torch ops: the table's rows, their halves, the products and the joins.
One program a row reads the row's table entry and rotates every head of it in float32
(the reference rotates in the input dtype, as transformers does: within one step of it).
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError


@triton.jit
def _rope_kernel(x_ptr, table_ptr, pos_ptr, out_ptr, num_heads, stride_xt, stride_xh, stride_xd, stride_table,
                 stride_ot, stride_oh, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h, j = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_HALF)
    cos = tl.load(table_ptr + pos * stride_table + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(table_ptr + pos * stride_table + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + HALF
    mask = (h[:, None] < num_heads) & (j[None, :] < HALF)
    row = x_ptr + t * stride_xt + h[:, None] * stride_xh
    x1 = tl.load(row + first[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + second[None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


def rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x [T, H, D]`` rotated at ``positions [T]`` by ``cos_sin [P, D]`` (a new tensor)."""
    if x.dim() != 3 or x.shape[-1] % 2 or cos_sin.shape[-1] != x.shape[-1] or positions.shape != x.shape[:1]:
        raise InternalError(f"rope wants x [T, H, D] with D even, cos_sin [P, D] and positions [T]; got "
                            f"{tuple(x.shape)}, {tuple(cos_sin.shape)}, {tuple(positions.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    heads, half = x.shape[1], x.shape[2] // 2
    cos_sin = cos_sin if cos_sin.stride(-1) == 1 else cos_sin.contiguous()
    _rope_kernel[(x.shape[0],)](
        x, cos_sin, positions, out, heads, x.stride(0), x.stride(1), x.stride(2), cos_sin.stride(0),
        out.stride(0), out.stride(1), HALF=half, INTERLEAVED=interleaved, BLOCK_H=next_power_of_2(heads),
        BLOCK_HALF=next_power_of_2(half), num_warps=4, **pdl.launch_options(x.device))
    return out
