"""Decode attention on the CPU: the kernel of ``cpu_attention.c`` for float32 caches.

A decode row's attention in torch (``torch_attention.lone_rows_attention``) copies its
request's keys and values out of the pages before one SDPA call, and runs some ten small
ops a layer; a CPU's decode step is bound by its small ops once its weights are read from
blocks (docs/PERFORMANCE.md). The C kernel reads the keys in place and computes the
softmax online in float32, one thread per (row, KV head) pair at a time; with the step's
rotation and cache write before it in the same call (``rope_decode_attention``), the
decode attention op is one call a layer. It takes float32 caches and heads of a multiple
of 16 elements, up to 256, with up to 16 query heads a KV head (``reads``); the other
decode rows run the torch formulation, the oracle it is tested against.
"""

import ctypes
from pathlib import Path

import torch

from tokenspeed.backends.kernels import c_library

SOURCE = Path(__file__).with_name("cpu_attention.c")
MAX_GROUP, MAX_DIM = 16, 256   # the C file's bounds

_I, _L, _P, _F = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = (("tokenspeed_decode_attention", (_P, _L, _L, _L, _L, _P, _P, _P, _L, _L, _P, _P, _L, _L, _L, _F, _P,
                                               _I)),
              ("tokenspeed_rope_decode_attention", (_P, _L, _P, _L, _P, _L, _L, _L, _L, _L, _P, _L, _P, _P, _P, _P, _P,
                                                    _L, _L, _P, _L, _L, _L, _F, _P, _P, _I)))
OUTSIDE = -3   # the C's status for a row outside the block tables, the cache or the rotary table


def _built() -> tuple[ctypes.CDLL | None, str]:
    return c_library.kernels(SOURCE, SIGNATURES)


def reads(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernel computes these rows' attention over one layer's ``kv``
    (``[2, slots, Hkv, D]``)."""
    heads, kv_heads, dim = q.shape[1], kv.shape[2], q.shape[2]
    return (q.device.type == "cpu" and q.dtype == kv.dtype == torch.float32 and dim % 16 == 0
            and dim <= MAX_DIM and kv.shape[3] == dim and heads % kv_heads == 0
            and heads // kv_heads <= MAX_GROUP and kv.is_contiguous() and _built()[0] is not None)


def decode_attention(q, kv, block_tables, row_request, positions, scale: float, page_size: int,
                     window: int) -> torch.Tensor:
    """Each row of ``q`` (``[rows, H, D]``) over its request's keys, as
    ``lone_rows_attention`` (without an FP8 cache's scales: the kernel reads float32)."""
    if not reads(q, kv):
        raise ValueError(f"the CPU's decode attention takes float32 q and cache, D a multiple of 16 up to "
                         f"{MAX_DIM}, at most {MAX_GROUP} query heads a KV head, a contiguous cache; got q "
                         f"{q.dtype} {tuple(q.shape)}, cache {kv.dtype} {tuple(kv.shape)}")
    rows, heads, dim = q.shape
    q, (tables, requests, positions) = q.contiguous(), _as_read(block_tables, row_request, positions)
    out = torch.empty(rows, heads, dim, dtype=torch.float32, device="cpu")
    status = c_library.call(_built(), "tokenspeed_decode_attention", q.data_ptr(), rows, heads, kv.shape[2], dim,
                            kv[0].data_ptr(), kv[1].data_ptr(), tables.data_ptr(), tables.shape[0], tables.shape[1],
                            requests.data_ptr(), positions.data_ptr(), page_size, kv.shape[1] // page_size, window,
                            scale, out.data_ptr(), torch.get_num_threads())
    _check(status, "tokenspeed_decode_attention", q, kv)
    return out


def _as_read(block_tables, row_request, positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The metadata as the C reads it: dense int32 block tables, int64 requests and
    positions (the same tensors when they are)."""
    return (block_tables.to(torch.int32).contiguous(), row_request.to(torch.int64).contiguous(),
            positions.to(torch.int64).contiguous())


def _check(status: int, name: str, q, kv) -> None:
    if status == OUTSIDE:
        raise IndexError(f"{name}: a row's request, position, page or slot lies outside the block tables, the cache "
                         f"({kv.shape[1]} slots) or the rotary table")
    if status:
        raise ValueError(f"{name} refused q {tuple(q.shape)} over kv {tuple(kv.shape)}")


def rope_reads(q, k, v, cos_sin, kv) -> bool:
    """Whether ``rope_decode_attention`` takes these: ``reads``, with float32 keys, values
    and table, each row's heads dense."""
    return (reads(q, kv) and k.dtype == v.dtype == cos_sin.dtype == torch.float32 and k.shape == v.shape
            and all(x.stride(2) == 1 and x.stride(1) == x.shape[2] for x in (q, k, v))
            and cos_sin.is_contiguous() and cos_sin.shape[1] == q.shape[2] and k.shape[1] == kv.shape[2])


def rope_decode_attention(q, k, v, cos_sin, positions, kv, slot_mapping, block_tables, row_request, scale: float,
                          page_size: int, window: int) -> torch.Tensor:
    """``reference.rope_decode_attention`` over one layer's float32 ``kv`` in one call: q
    and k rotated (bit for bit ``apply_rotary``), k and v written at ``slot_mapping``, then
    ``decode_attention``."""
    if not rope_reads(q, k, v, cos_sin, kv):
        raise ValueError(f"the CPU's rope_decode_attention takes float32 q, k, v, table and cache with each row's "
                         f"heads dense; got q {q.dtype} {tuple(q.shape)} {q.stride()}, k {k.dtype} {k.stride()}, "
                         f"v {v.dtype} {v.stride()}, table {cos_sin.dtype} {tuple(cos_sin.shape)}")
    rows, heads, dim = q.shape
    tables, requests, positions = _as_read(block_tables, row_request, positions)
    slots = slot_mapping.to(torch.int64).contiguous()
    q_rot, out = (torch.empty(rows, heads, dim, dtype=torch.float32, device="cpu") for _ in range(2))
    status = c_library.call(_built(), "tokenspeed_rope_decode_attention", q.data_ptr(), q.stride(0), k.data_ptr(),
                            k.stride(0), v.data_ptr(), v.stride(0), rows, heads, kv.shape[2], dim, cos_sin.data_ptr(),
                            cos_sin.shape[0], positions.data_ptr(), slots.data_ptr(), kv[0].data_ptr(),
                            kv[1].data_ptr(), tables.data_ptr(), tables.shape[0], tables.shape[1], requests.data_ptr(),
                            page_size, kv.shape[1] // page_size, window, scale, q_rot.data_ptr(), out.data_ptr(),
                            torch.get_num_threads())
    _check(status, "tokenspeed_rope_decode_attention", q, kv)
    return out
