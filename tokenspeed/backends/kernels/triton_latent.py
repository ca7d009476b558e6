"""A latent-attention layer's cache write as one launch (``tokenspeed::norm_rope_write_latent``;
the reference is ``reference.norm_rope_write_latent``).

DeepSeek's layer caches, per token, its latent after ``kv_a_layernorm`` and its rope key
after the rotary: as separate ops a norm, a rotation, a join and an indexed copy, four
launches a layer. One program a row normalises the latent (rounding as transformers'
RMSNorm does: the normalised row in the input dtype before the weight's product), rotates
the rope key in float32 and stores both into the row's cache slot.
"""

from typing import NamedTuple

import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError


@triton.jit
def _latent_write_kernel(latent_ptr, w_ptr, rope_ptr, table_ptr, pos_ptr, slot_ptr, cache_ptr, eps,
                         stride_l, stride_r, stride_table, stride_pos, stride_sm, stride_slot,
                         LATENT: tl.constexpr, HALF: tl.constexpr,
                         INTERLEAVED: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
                         USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    write_latent_row(tl.program_id(0).to(tl.int64), latent_ptr, w_ptr, rope_ptr, table_ptr, pos_ptr, slot_ptr,
                     cache_ptr, eps, stride_l, stride_r, stride_table, stride_pos, stride_sm, stride_slot,
                     LATENT, HALF, INTERLEAVED, BLOCK_L, BLOCK_HALF)


@triton.jit
def write_latent_row(t, latent_ptr, w_ptr, rope_ptr, table_ptr, pos_ptr, slot_ptr, cache_ptr, eps,
                     stride_l, stride_r, stride_table, stride_pos, stride_sm, stride_slot,
                     LATENT: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_L: tl.constexpr,
                     BLOCK_HALF: tl.constexpr):
    """Row ``t``'s normed latent and rotated rope key into its cache slot (after the PDL wait:
    the latent is the projection's output). ``triton_mla``'s absorption launch calls it too."""
    row = cache_ptr + tl.load(slot_ptr + t * stride_sm).to(tl.int64) * stride_slot   # a strided column of slots
    c = tl.arange(0, BLOCK_L)
    x = tl.load(latent_ptr + t * stride_l + c, mask=c < LATENT, other=0.0).to(tl.float32)
    normed = (x / tl.sqrt(tl.sum(x * x, 0) / LATENT + eps)).to(latent_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=c < LATENT, other=0.0).to(tl.float32)
    out = (w * normed).to(latent_ptr.dtype.element_ty)
    tl.store(row + c, out.to(cache_ptr.dtype.element_ty), mask=c < LATENT)
    j = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + t * stride_pos).to(tl.int64)
    cos = tl.load(table_ptr + pos * stride_table + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(table_ptr + pos * stride_table + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    if INTERLEAVED:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + HALF
    x1 = tl.load(rope_ptr + t * stride_r + first, mask=j < HALF, other=0.0).to(tl.float32)
    x2 = tl.load(rope_ptr + t * stride_r + second, mask=j < HALF, other=0.0).to(tl.float32)
    ty = rope_ptr.dtype.element_ty
    tl.store(row + LATENT + j, (x1 * cos - x2 * sin).to(ty).to(cache_ptr.dtype.element_ty), mask=j < HALF)
    tl.store(row + LATENT + HALF + j, (x2 * cos + x1 * sin).to(ty).to(cache_ptr.dtype.element_ty), mask=j < HALF)


class LatentWrite(NamedTuple):
    """A launch's latent write, checked and laid out: ``args`` then ``constants`` are
    ``write_latent_row``'s after the row index (``_latent_write_kernel``'s, and the absorption
    launch's that writes as it absorbs, ``triton_mla``)."""
    rows: int
    args: tuple
    constants: dict

    @classmethod
    def of(cls, latent, norm_weight, eps, k_rope, cos_sin, positions, interleaved, kv_cache, layer,
           slot_mapping) -> "LatentWrite":
        """``latent [T, C]``, ``k_rope [T, 1, D]``; ``kv_cache`` the IR's ``[L, 1, pages, P, 1, C + D]``."""
        rows, width = latent.shape[0], latent.shape[-1]
        dim = k_rope.shape[-1]
        if latent.dim() != 2 or k_rope.shape != (rows, 1, dim) or dim % 2 or kv_cache.shape[-1] != width + dim \
                or cos_sin.shape[-1] != dim:
            raise InternalError(f"norm_rope_write_latent wants latent [T, C], k_rope [T, 1, D] (D even) and a "
                                f"cache of C + D; got {tuple(latent.shape)}, {tuple(k_rope.shape)}, "
                                f"{tuple(kv_cache.shape)}")
        cache = kv_cache[layer, 0].flatten(0, 1)[:, 0]            # [slots, C + D]
        latent = latent if latent.stride(-1) == 1 else latent.contiguous()
        k_rope = k_rope if k_rope.stride(-1) == 1 else k_rope.contiguous()
        args = (latent, norm_weight, k_rope, cos_sin, positions, slot_mapping, cache, float(eps), latent.stride(0),
                k_rope.stride(0), cos_sin.stride(0), positions.stride(0), slot_mapping.stride(0), cache.stride(0))
        constants = dict(LATENT=width, HALF=dim // 2, INTERLEAVED=interleaved, BLOCK_L=next_power_of_2(width),
                         BLOCK_HALF=next_power_of_2(dim // 2))
        return cls(rows, args, constants)


def norm_rope_write_latent(latent, norm_weight, eps, k_rope, cos_sin, positions, interleaved, kv_cache, layer,
                           slot_mapping) -> None:
    """``latent [T, C]``, ``k_rope [T, 1, D]``; ``kv_cache`` the IR's ``[L, 1, pages, P, 1, C + D]``."""
    write_latents(LatentWrite.of(latent, norm_weight, eps, k_rope, cos_sin, positions, interleaved, kv_cache, layer,
                                 slot_mapping))


def write_latents(write: LatentWrite) -> None:
    """One program a row."""
    if write.rows:
        _latent_write_kernel[(write.rows,)](*write.args, **write.constants, num_warps=4,
                                            **pdl.launch_options(write.args[0].device))
