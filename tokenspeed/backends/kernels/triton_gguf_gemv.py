"""Matrix-vector product over a GGUF weight: ``x [1, K] @ W[N, K].T`` for a decode step
of one row, W read as its blocks (``gguf_blocks.py``) and decoded in registers.

One row only streams the weight, so speed is the bytes read: a quantized weight is 2-4x
fewer than bf16. Each program owns ``BLOCK_N`` output rows and walks K in tiles of
``GROUPS`` scale groups, accumulating products elementwise in fp32 (no tensor-core
padding for one row) and summing once at the end. Under PDL the first weight tile is
decoded before the program waits for the kernel that writes x. Several rows go to
``triton_gguf_matmul`` (tensor cores, the weight still read once for up to 16 rows).
"""

import attrs
import torch
import triton
import triton.language as tl

from tokenspeed.backends.kernels import pdl
from tokenspeed.backends.kernels.gguf_blocks import BlockFormat, check_linear
from tokenspeed.backends.kernels.triton_gguf_dequant import weight_tile


@attrs.frozen
class GemvConfig:
    """Output rows per program, scale groups per K tile, and the launch's warps."""
    block_n: int
    groups: int
    num_warps: int


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                 FORMAT: tl.constexpr, TYPE_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl.start(USE_PDL)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    groups = K // GROUP
    BLOCK_K: tl.constexpr = GROUPS * GROUP
    kk = tl.arange(0, BLOCK_K)
    w = weight_tile(w_ptr, n, nmask, 0, groups, stride_wn, FORMAT, TYPE_SIZE, BLOCK_N,
                    GROUPS, GROUP)
    pdl.wait(USE_PDL)
    x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
    acc = w * x[None, :]
    for k0 in range(BLOCK_K, K, BLOCK_K):  # the first tile, peeled, came before the wait
        w = weight_tile(w_ptr, n, nmask, k0 // GROUP, groups, stride_wn, FORMAT, TYPE_SIZE,
                        BLOCK_N, GROUPS, GROUP)
        x = tl.load(x_ptr + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=nmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=nmask)


def choose_config(n: int, k: int, fmt: BlockFormat) -> GemvConfig:
    """Thin column blocks keep every SM busy without splitting K (the 1B model's smallest
    projection, 2048 rows, gives 512 programs); a K tile of 512 elements (a Q4_K tile
    is 288 bytes a row) keeps several loads in flight per program. Not yet swept on a GPU."""
    block_n = 4 if n >= 1024 else 2
    tile = min(512, max(fmt.group_size, triton.next_power_of_2(k)))
    return GemvConfig(block_n, tile // fmt.group_size, 4)


def gemv(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat, bias: torch.Tensor = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """``x [1, K] @ dequantize(weight).T (+ bias)`` as ``[1, N]`` in x's dtype, fp32
    accumulation; ``weight`` is ``uint8 [N, row_bytes]`` in ``fmt``."""
    k, n = check_linear(x, weight, fmt, bias)
    if x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, {k}]; got {tuple(x.shape)}")
    x = x.contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    config = config or choose_config(n, k, fmt)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else x, out, n, k, weight.stride(0),
        FORMAT=fmt.code, TYPE_SIZE=fmt.type_size, HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, GROUPS=config.groups, GROUP=fmt.group_size,
        num_warps=config.num_warps, **pdl.launch_options(x.device))
    return out
