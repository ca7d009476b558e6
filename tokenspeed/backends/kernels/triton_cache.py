"""Triton kernels that maintain the paged KV cache.

``write_kv`` scatters one token's K and V rows into their cache slots with a single launch
(one program per token), so the step that feeds attention costs one kernel instead of two
``index_copy_`` calls, and it takes K/V as strided views (e.g. slices of a fused QKV
projection) without a copy. It reads no tensor values on the host and is safe inside CUDA-graph
capture.

Layout (see ``reference.py``): ``kv_cache[layer, 0 | 1, slot, kv_head, head_dim]``,
``slot = page * page_size + offset``, page 0 is the null page that padding rows write into.

``to_cache`` is how every kernel writes a cache element: a float8 cache stores
``x / scale`` saturated at +-448 (``kv_fp8``); another dtype is a plain cast. Readers widen
what they load to the queries' type (``as_query``). The float8 conversion happens in the kernel
(under the Triton interpreter it rounds wrongly where rounding carries into the next
exponent; ``tests/test_fp8_kv_kernels.py`` says how its tests keep clear of that).
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import kv_fp8, pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.errors import InternalError

FP8_MAX = tl.constexpr(kv_fp8.FP8_MAX)


@triton.jit
def to_cache(x, scale, CACHE_TY: tl.constexpr):
    """``x`` as a cache of ``CACHE_TY`` stores it."""
    if CACHE_TY.is_fp8():
        return tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX).to(CACHE_TY)
    return x.to(CACHE_TY)


@triton.jit
def as_query(q, CACHE_TY: tl.constexpr):
    """Queries in the type products with the cache's keys run in: the cache's, unless it
    is float8, whose keys are widened to the queries' type instead. One expression: Triton
    compiles both returns of a constexpr branch, and they would differ in type."""
    return q.to(q.dtype if CACHE_TY.is_fp8() else CACHE_TY)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_sm, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_slot, stride_ch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token * stride_sm).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    src = token.to(tl.int64) * stride_kt + h[:, None] * stride_kh + d[None, :]
    dst = slot * stride_slot + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + src, mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_scale, k_cache_ptr.dtype.element_ty), mask=mask)
    src = token.to(tl.int64) * stride_vt + h[:, None] * stride_vh + d[None, :]
    v = tl.load(v_ptr + src, mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_scale, v_cache_ptr.dtype.element_ty), mask=mask)


def _unit_last_dim(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write ``k[t], v[t]`` ([T, Hkv, D]) into slot ``slot_mapping[t]`` of ``layer``
    (through ``k_scale`` and ``v_scale`` into a float8 cache)."""
    if k.dim() != 3 or k.shape != v.shape:
        raise InternalError(f"k and v must both be [T, Hkv, D]; got {tuple(k.shape)} "
                            f"and {tuple(v.shape)}")
    tokens, heads, head_dim = k.shape
    if kv_cache.shape[3:] != (heads, head_dim):
        raise InternalError(f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} do not match "
                            f"k's ({heads}, {head_dim})")
    if slot_mapping.shape != (tokens,):
        raise InternalError(f"slot_mapping must be [{tokens}]; got {tuple(slot_mapping.shape)}")
    if tokens == 0:
        return
    k, v = _unit_last_dim(k), _unit_last_dim(v)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    if k_cache.stride(-1) != 1:
        raise InternalError("kv_cache must have a contiguous head_dim")
    _write_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping, slot_mapping.stride(0),   # a cache group's column
        *kv_fp8.applied(kv_cache.dtype, k_scale, v_scale),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
        k_cache.stride(1),
        NUM_HEADS=heads, HEAD_DIM=head_dim,
        BLOCK_H=next_power_of_2(heads), BLOCK_D=next_power_of_2(head_dim),
        num_warps=4 if heads * head_dim >= 1024 else 1, **pdl.launch_options(k.device))
