"""Fused elementwise Triton kernels for the decoder layer (references in ``reference.py``).

Decode steps are launch- and bandwidth-bound: fusing residual-add with RMSNorm, SiLU with
the gate*up product, and rotary embedding with the KV-cache write saves a round trip to
memory and a launch per op. Rounding follows HF Llama so results match a bf16 HF model:
the residual sum is rounded to the input dtype before the norm, the normalised hidden is
cast to the input dtype before the weight multiply, and SiLU is rounded before the product.

Rotary tables are ``tokenspeed.ir.rope.cos_sin_table`` rows over every position; the
kernel rotates in float32 (the reference in the input dtype, as HF does: within a bf16
step of each other).
"""

import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import kv_fp8, pdl
from tokenspeed.backends.kernels.blocks import next_power_of_2
from tokenspeed.backends.kernels.triton_cache import to_cache
from tokenspeed.errors import InternalError


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, stride_x, stride_r,
                     stride_o, stride_nr, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < hidden
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        rounded = x.to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + c, rounded, mask=mask)
        x = rounded.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows_2d(x: torch.Tensor, name: str) -> torch.Tensor:
    """[..., width] -> [rows, width] with a unit last stride (a view when possible)."""
    if x.dim() < 1:
        raise InternalError(f"{name} must have a last (hidden) dim; got shape {tuple(x.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _norm(x, residual, weight, eps):
    shape = x.shape
    if weight.shape != (shape[-1],):
        raise InternalError(f"weight must be [{shape[-1]}]; got {tuple(weight.shape)}")
    if residual is not None and residual.shape != shape:
        raise InternalError(f"residual {tuple(residual.shape)} must match x {tuple(shape)}")
    x = _rows_2d(x, "x")
    res = _rows_2d(residual, "residual") if residual is not None else x
    out = torch.empty_like(x)
    new_res = torch.empty_like(x) if residual is not None else out
    if x.numel():
        block = next_power_of_2(x.shape[1])
        _rms_norm_kernel[(x.shape[0],)](
            x, res, weight.contiguous(), out, new_res, x.stride(0), res.stride(0),
            out.stride(0), new_res.stride(0), x.shape[1], eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_num_warps(block),
            **pdl.launch_options(x.device))
    return out.view(shape), new_res.view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (fp32 statistics, HF rounding), output in x.dtype."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x, residual, weight, eps):
    """(rms_norm(x + residual), x + residual), the sum rounded to x.dtype first."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < inter
    gate = tl.load(gu_ptr + row * stride_gu + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + inter + c, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2I] (gate first): returns [..., I]."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise InternalError(f"gate_up last dim must be even; got shape {tuple(gate_up.shape)}")
    shape = gate_up.shape
    gate_up = _rows_2d(gate_up, "gate_up")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if tokens and inter:
        block = min(1024, next_power_of_2(inter))
        _silu_mul_kernel[(tokens, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block,
            num_warps=_num_warps(block), **pdl.launch_options(out.device))
    return out.view(*shape[:-1], inter)


@triton.jit
def _rotate(x_ptr, stride_h, num_heads, cos, sin,
            HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Load heads [BLOCK_H, D] at x_ptr; return both rotated halves in fp32 and the mask."""
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (j[None, :] < HALF)
    offs = h[:, None] * stride_h + j[None, :]
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask


@triton.jit
def _rope_kv_kernel(q_ptr, k_ptr, v_ptr, cache_ptr, pos_ptr, slot_ptr, stride_sm, q_out_ptr,
                    k_cache_ptr, v_cache_ptr, k_scale, v_scale, stride_qt, stride_qh, stride_kt, stride_kh,
                    stride_vt, stride_vh, stride_cache, stride_ot, stride_oh, stride_slot, stride_ch,
                    NUM_Q: tl.constexpr, NUM_KV: tl.constexpr, HALF: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                    USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + j, mask=j < HALF,
                  other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    o1, o2, mask = _rotate(q_ptr + t * stride_qt, stride_qh, NUM_Q, cos, sin, HALF,
                              BLOCK_Q, BLOCK_HALF)
    h = tl.arange(0, BLOCK_Q)
    out = q_out_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(out, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=mask)

    slot = tl.load(slot_ptr + t * stride_sm).to(tl.int64)
    o1, o2, mask = _rotate(k_ptr + t * stride_kt, stride_kh, NUM_KV, cos, sin, HALF,
                              BLOCK_KV, BLOCK_HALF)
    h = tl.arange(0, BLOCK_KV)
    dst = k_cache_ptr + slot * stride_slot + h[:, None] * stride_ch + j[None, :]
    k_ty = k_ptr.dtype.element_ty
    c_ty = k_cache_ptr.dtype.element_ty
    tl.store(dst, to_cache(o1.to(k_ty), k_scale, c_ty), mask=mask)
    tl.store(dst + HALF, to_cache(o2.to(k_ty), k_scale, c_ty), mask=mask)
    src = v_ptr + t * stride_vt + h[:, None] * stride_vh + j[None, :]
    dst = v_cache_ptr + slot * stride_slot + h[:, None] * stride_ch + j[None, :]
    tl.store(dst, to_cache(tl.load(src, mask=mask), v_scale, c_ty), mask=mask)
    tl.store(dst + HALF, to_cache(tl.load(src + HALF, mask=mask), v_scale, c_ty), mask=mask)


def rope_and_write_kv(q, k, v, cos_sin_cache, positions, kv_cache, layer, slot_mapping, k_scale=1.0,
                      v_scale=1.0):
    """Rotate q [T, H, D] and k [T, Hkv, D] at ``positions``; write rotated k and v to the
    cache slots ``slot_mapping`` (through ``k_scale`` and ``v_scale`` into a float8 cache);
    return the rotated q (new tensor). Math in fp32."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise InternalError(f"q must be [T, H, D] and k, v [T, Hkv, D]; got {tuple(q.shape)}, "
                            f"{tuple(k.shape)}, {tuple(v.shape)}")
    tokens, heads, head_dim = q.shape
    if head_dim % 2 or k.shape[2] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise InternalError(f"head_dim {head_dim} must be even and match k and cos_sin_cache "
                            f"(last dims {k.shape[2]}, {cos_sin_cache.shape[-1]})")
    if kv_cache.shape[3:] != k.shape[1:]:
        raise InternalError(f"kv_cache heads/head_dim {tuple(kv_cache.shape[3:])} must match "
                            f"k's {tuple(k.shape[1:])}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]
    if tokens == 0:
        return q_out
    half = head_dim // 2
    _rope_kv_kernel[(tokens,)](
        q, k, v, cos_sin_cache, positions, slot_mapping, slot_mapping.stride(0), q_out, k_cache,
        v_cache, *kv_fp8.applied(kv_cache.dtype, k_scale, v_scale), q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), q_out.stride(0), q_out.stride(1), k_cache.stride(0),
        k_cache.stride(1), NUM_Q=heads, NUM_KV=k.shape[1], HALF=half,
        BLOCK_Q=next_power_of_2(heads), BLOCK_KV=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half), num_warps=4, **pdl.launch_options(q.device))
    return q_out
