"""GGUF weights kept in their blocks on the CPU: the kernels of ``cpu_blocks.c``.

A CPU's decode step is bound by the weight bytes it reads. The default model's file holds
Q4_1 layers and a Q8_0 embedding (the tied head): 538 MB a token once dequantized to
float32, about 100 MB as blocks. Every GGUF block format is read (the simple ones and the
K-quants). These kernels decode each block in registers to exactly the float32 weights
``gguf``'s dequantization gives (what transformers computes with) and sum float32
products, so a result differs from the dequantized model's only in the order of its sums.

Up to ``GEMV_ROWS`` rows (decode) take the block product, which also makes its input (a
norm, a gated activation: ``norm_linear``, ``gated_linear``); more rows (a prompt's chunk)
dequantize the matrix for torch's BLAS. The default model's matrices (2-core Xeon), ms,
blocks / dequantized then BLAS / float32 weights held: 1 row 9.6 / 142 / 22, 16 rows 25 / 70
/ 49, 32 rows 49 / 92 / 57, 64 rows 98 / 128 / 92, 128 rows 180 / 178 / 141 (up to 64 rows
the blocks keep pace with a model held in float32, which reads five times the bytes). The
C is built on first use (``c_library``); where no compiler builds it, ``available()`` says
why, and ``ts.LLM`` loads GGUF files dequantized on the CPU (``api/model_source.kept_blocks``).
"""

import ctypes
from pathlib import Path

import torch

from tokenspeed.backends.kernels import c_library
from tokenspeed.backends.kernels.gguf_blocks import Q, BlockFormat, check_linear, check_weight

FORMATS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)   # every block format
FORMAT_NAMES = tuple(q.name for q in FORMATS)
GEMV_ROWS = 64   # rows up to which the product reads the blocks; more dequantize first
SOURCE = Path(__file__).with_name("cpu_blocks.c")

_I, _L, _P, _F = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = (("tokenspeed_block_linear", (_I, _P, _L, _L, _P, _L, _L, _P, _I)),
              ("tokenspeed_block_dequantize", (_I, _P, _L, _L, _L, _P, _I)),
              ("tokenspeed_block_norm_linear", (_I, _P, _P, _P, _F, _L, _L, _P, _L, _L, _P, _P, _P, _I)),
              ("tokenspeed_block_gated_linear", (_I, _P, _L, _L, _P, _L, _L, _P, _P, _I)))


def _built() -> tuple[ctypes.CDLL | None, str]:
    return c_library.kernels(SOURCE, SIGNATURES)


def available() -> bool:
    return _built()[0] is not None


def unavailable_reason() -> str:
    return _built()[1]


def reads(fmt: BlockFormat, device) -> bool:
    """Whether these kernels compute ``fmt``'s blocks on ``device``."""
    return torch.device(device).type == "cpu" and fmt.qtype in FORMATS and not fmt.gathered and available()


def linear(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None) -> torch.Tensor:
    """``x @ dequantize(weight).T + bias`` in float32, rounded to x's dtype (as
    ``gguf_reference.linear``)."""
    rows = x.reshape(-1, x.shape[-1])
    features, outputs = _checked(rows, weight, fmt, bias)
    rows = rows.float().contiguous()   # the same tensor when it is float32 and dense
    if rows.shape[0] > GEMV_ROWS:
        out = torch.nn.functional.linear(rows, dequantize(weight, fmt))
    else:
        out = torch.empty(rows.shape[0], outputs, dtype=torch.float32, device="cpu")
        _call("tokenspeed_block_linear", fmt.code, rows.data_ptr(), rows.shape[0], features, weight.data_ptr(),
              outputs, weight.shape[1], out.data_ptr(), torch.get_num_threads())
    out = _biased(out, bias, x.shape[:-1])
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def prepares_input(fmt: BlockFormat, x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether ``norm_linear`` or ``gated_linear`` make their product's input in C: rows
    the block product takes (up to ``GEMV_ROWS``), float32 and dense like ``others`` (a
    residual, a norm's weight; None is absent)."""
    dense = [t for t in (x, *others) if t is not None]
    return (reads(fmt, x.device) and x.reshape(-1, x.shape[-1]).shape[0] <= GEMV_ROWS
            and all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu" for t in dense))


def norm_linear(x, residual, norm_weight, eps: float, weight, fmt: BlockFormat, bias=None) -> list:
    """``reference.norm_linear``'s outputs (``[out]``, or ``[out, x + residual]``), float32,
    with the float32 RMSNorm computed by the C before its product (``prepares_input``)."""
    rows = x.reshape(-1, x.shape[-1])
    features, outputs = _checked(rows, weight, fmt, bias)
    if norm_weight.shape != (features,) or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"norm_linear: x {tuple(x.shape)} needs a norm weight of [{features}] and a residual of its "
                         f"shape; got {tuple(norm_weight.shape)} and "
                         f"{None if residual is None else tuple(residual.shape)}")
    rows, norm_weight = rows.float().contiguous(), norm_weight.float().contiguous()   # as they are, if dense float32
    residual = None if residual is None else residual.float().contiguous()
    normed = torch.empty(rows.shape, dtype=torch.float32, device="cpu")
    total = None if residual is None else torch.empty(x.shape, dtype=torch.float32, device="cpu")
    out = torch.empty(rows.shape[0], outputs, dtype=torch.float32, device="cpu")
    _call("tokenspeed_block_norm_linear", fmt.code, rows.data_ptr(), 0 if residual is None else residual.data_ptr(),
          norm_weight.data_ptr(), eps, rows.shape[0], features, weight.data_ptr(), outputs, weight.shape[1],
          normed.data_ptr(), 0 if total is None else total.data_ptr(), out.data_ptr(), torch.get_num_threads())
    out = _biased(out, bias, x.shape[:-1])
    return [out] if total is None else [out, total]


def gated_linear(gate_up, weight, fmt: BlockFormat, bias=None) -> torch.Tensor:
    """``linear(silu(gate) * up)`` for ``gate_up`` (gate, then up, on its last axis), float32,
    the activation computed by the C before its product (``prepares_input``)."""
    rows = gate_up.reshape(-1, gate_up.shape[-1]).float().contiguous()
    features, outputs = _checked(rows[:, : rows.shape[1] // 2], weight, fmt, bias)
    if rows.shape[1] != 2 * features:
        raise ValueError(f"gated_linear: gate_up must be [M, {2 * features}] for a weight of {features} columns; "
                         f"got {tuple(gate_up.shape)}")
    act = torch.empty(rows.shape[0], features, dtype=torch.float32, device="cpu")
    out = torch.empty(rows.shape[0], outputs, dtype=torch.float32, device="cpu")
    _call("tokenspeed_block_gated_linear", fmt.code, rows.data_ptr(), rows.shape[0], features, weight.data_ptr(),
          outputs, weight.shape[1], act.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return _biased(out, bias, gate_up.shape[:-1])


def _biased(out: torch.Tensor, bias: torch.Tensor | None, lead: torch.Size) -> torch.Tensor:
    """``out [rows, N]`` (+ bias) shaped ``[*lead, N]``."""
    return (out if bias is None else out + bias.float()).view(*lead, out.shape[-1])


def dequantize(weight: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``float32 [N, K]``: equal to ``gguf``'s dequantization, bit for bit."""
    features = _checked_weight(weight, fmt)
    out = torch.empty(weight.shape[0], features, dtype=torch.float32, device="cpu")
    _call("tokenspeed_block_dequantize", fmt.code, weight.data_ptr(), weight.shape[0], features,
          weight.shape[1], out.data_ptr(), torch.get_num_threads())
    return out


def _checked(rows: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias) -> tuple[int, int]:
    """(K, N) of ``rows @ weight.T + bias``, a product these kernels compute."""
    _checked_weight(weight, fmt)
    return check_linear(rows, weight, fmt, bias)


def _checked_weight(weight: torch.Tensor, fmt: BlockFormat) -> int:
    """K of ``weight``, a contiguous CPU tensor of ``fmt``'s blocks, one of ``FORMATS``."""
    if fmt.qtype not in FORMATS or fmt.gathered:
        raise ValueError(f"the CPU's block kernels read {', '.join(FORMAT_NAMES)}; got {fmt.name}")
    if weight.device.type != "cpu" or not weight.is_contiguous():
        raise ValueError(f"a {fmt.name} weight for the CPU's kernels must be a contiguous CPU tensor; "
                         f"got one on {weight.device}, contiguous={weight.is_contiguous()}")
    return check_weight(weight, fmt)


def _call(name: str, *args) -> None:
    status = c_library.call(_built(), name, *args)
    if status == -2:
        raise MemoryError(f"{name}: no memory for the rows' block sums")
    if status:
        raise ValueError(f"{name}: format {args[0]} is not one of {', '.join(FORMAT_NAMES)}")
