"""GGUF block formats as the kernels read them: a quantized weight stays its file's bytes.

A weight of ``N`` output features by ``K`` inputs is ``uint8 [N, row_bytes]`` on the
device, each row ``K / block_size`` blocks of ``type_size`` bytes laid out as llama.cpp
writes them (block and type sizes from the ``gguf`` package). Inside a block, a *group*
is the run of elements that share one scale (and offset): the whole block for the simple
formats, 32 of a K-quant's 256 (Q4_K, Q5_K) or 16 (Q6_K). Kernels decode a tile as
``groups x group_size`` so that each scale is read once per group, not per element.

One layout is not a file's: ``Q8_0_G8``, Q8_0's blocks in runs of eight with their eight
fp16 scales gathered ahead of their 256 quants (272 bytes, the same as eight blocks). A
Q8_0 block is 34 bytes, so its quants sit at every alignment and a GPU reads them a byte
or two a load; gathered, each block's 32 quants are 16-byte aligned (rows of whole runs,
K a multiple of 256), read 16 bytes a load. Every bit of every block is kept:
``gather_scales`` and ``scatter_scales`` move bytes only. A GPU's loader regathers a
Q8_0 output head only (and its table when tied: ``models.block_layers.gather_q8_0_head``),
whose one-row products ``triton_gguf_wide`` reads in 0.61x the file's blocks' time on an
H100; for the other weights the unit GEMV's K splits (narrow ones) or a decode batch's
tensor-core matmul (a gate/up: 1.3x the time at 32 rows) read the file's blocks faster
(docs/PERFORMANCE.md, forty-ninth session).
"""

import attrs
import torch
from gguf.constants import GGML_QUANT_SIZES, QK_K, GGMLQuantizationType

from tokenspeed.ir.weights import GATHERED, GATHERED_RUN

Q = GGMLQuantizationType
SIMPLE_FORMATS = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
K_FORMATS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
SUPPORTED = SIMPLE_FORMATS + K_FORMATS
GATHERED_CODE = 1000 + int(Q.Q8_0)   # the kernels' FORMAT for Q8_0_G8 (not a ggml type id)


@attrs.frozen
class BlockFormat:
    """One GGUF block format: its type, its block's elements and bytes, and its groups."""
    qtype: GGMLQuantizationType
    block_size: int
    type_size: int
    group_size: int
    gathered: bool = False    # Q8_0_G8: the blocks are runs of eight, scales first

    @property
    def name(self) -> str:
        return GATHERED if self.gathered else self.qtype.name

    @property
    def code(self) -> int:
        """The kernels' ``FORMAT`` constexpr: the ggml type id, or ``GATHERED_CODE``."""
        return GATHERED_CODE if self.gathered else int(self.qtype)

    def row_bytes(self, features: int) -> int:
        """Bytes of a row of ``features`` elements (a multiple of the block size)."""
        if features % self.block_size:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.block_size} "
                             f"elements; got {features}")
        return features // self.block_size * self.type_size

    def features(self, row_bytes: int) -> int:
        """Elements of a row of ``row_bytes`` bytes (a multiple of the type size)."""
        if row_bytes % self.type_size:
            raise ValueError(f"{self.name} rows hold whole blocks of {self.type_size} "
                             f"bytes; got {row_bytes}")
        return row_bytes // self.type_size * self.block_size


def _group_size(qtype: GGMLQuantizationType) -> int:
    """Elements sharing one scale: a K-quant's sub-block (Q6_K: 16 scales a block, Q4_K
    and Q5_K: 8), a simple format's whole block."""
    if qtype == Q.Q6_K:
        return QK_K // 16
    if qtype in (Q.Q4_K, Q.Q5_K):
        return QK_K // 8
    return GGML_QUANT_SIZES[qtype][0]


def block_format(qtype) -> BlockFormat:
    """The layout of ``qtype`` (a ``GGMLQuantizationType``, its name or its id, or
    ``GATHERED``)."""
    if qtype == GATHERED:
        q8 = block_format(Q.Q8_0)
        return BlockFormat(Q.Q8_0, GATHERED_RUN * q8.block_size, GATHERED_RUN * q8.type_size, q8.group_size,
                           gathered=True)
    try:
        qtype = Q[qtype] if isinstance(qtype, str) else Q(qtype)
    except (KeyError, ValueError):
        raise ValueError(f"unknown GGUF type {qtype!r}") from None
    if qtype not in SUPPORTED:
        names = ", ".join(q.name for q in SUPPORTED)
        raise ValueError(f"GGUF type {qtype.name} has no kernel; supported: {names}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return BlockFormat(qtype, block_size, type_size, _group_size(qtype))


def check_weight(weight: torch.Tensor, fmt: BlockFormat) -> int:
    """K of a quantized weight ``uint8 [N, row_bytes]``, after checking its shape."""
    if weight.dtype != torch.uint8 or weight.dim() != 2:
        raise ValueError(f"a {fmt.name} weight must be uint8 [N, row_bytes]; got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"a {fmt.name} weight's rows must be contiguous; got strides "
                         f"{weight.stride()}")
    if weight.data_ptr() % 2 or weight.stride(0) % 2:
        raise ValueError(f"a {fmt.name} weight's rows must start at even addresses (its fp16 "
                         f"scales are read 2 bytes at a time); got address "
                         f"{weight.data_ptr():#x} and row stride {weight.stride(0)}")
    return fmt.features(weight.shape[1])


def check_linear(x: torch.Tensor, weight: torch.Tensor, fmt: BlockFormat,
                 bias: torch.Tensor | None) -> tuple[int, int]:
    """(K, N) of a well-formed ``x [M, K] @ weight.T + bias``."""
    k, n = check_weight(weight, fmt), weight.shape[0]
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be [M, {k}] for a {fmt.name} weight of {k} columns; got "
                         f"{tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32; got {x.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    return k, n
