"""Weight formats the IR's matrix ops accept: a dense weight in the activations' dtype,
a GGUF block format whose bytes stay as the file stores them (``Q8_0_G8``: Q8_0's,
regathered on a GPU, ``backends/kernels/gguf_blocks.py``), FP8 (e4m3) with scales, or
the CPU's weight-only integers of ``quantization="int4"``: int4 in torch's packed CPU
layout with a scale and zero per group of 32 (``INT4``; ``weight_scale`` ``bfloat16
[K / 32, N, 2]``), and int8 with a scale per output channel for the head (``INT8``;
``weight_scale`` ``bfloat16 [N]``).

The ops take the weight tensor and its format's name (``weight_format``), so a graph
shows one ``tokenspeed::linear`` whatever the weight, and a backend picks the kernel that
reads the format. The block layouts themselves are the ``gguf`` package's (read by the
backends); the IR only names the formats it carries. An FP8 weight's ``weight_scale`` is
the op's last argument: float32 ``[N]`` (one scale per output channel) or
``[ceil(N / 128), ceil(K / 128)]`` (one per 128 x 128 tile); weight = fp8 value x scale.
The FP8 grid's bound and the per-channel quantizer live here too: ``quantization="fp8"``
quantizes at load with it (models), the kernels' reference and tests with it (backends).
"""

import attrs
import torch

DENSE = "dense"
GATHERED = "Q8_0_G8"      # Q8_0 regathered on a GPU (backends/kernels/gguf_blocks.py)
GATHERED_RUN = 8          # the Q8_0 blocks of a Q8_0_G8 run, their fp16 scales gathered first
Q8_0_BLOCK_BYTES = 34     # an fp16 scale and 32 int8 quants (gguf's GGML_QUANT_SIZES; tested)
GATHERED_RUN_BYTES = GATHERED_RUN * Q8_0_BLOCK_BYTES
WIDE_ROWS = 8192          # a block weight of this many rows (1B: gate/up, head) is wide: a GPU
                          # reads one row's product by 2-D tiles (Q4_K, Q8_0_G8)
BLOCK_FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", GATHERED)
FP8 = "fp8_e4m3"
INT4 = "int4_g32"
INT4_GROUP = 32  # K elements sharing an int4 weight's scale and zero
INT8 = "int8_channel"
FP8_TILE = 128   # the side of a tile sharing one scale in block-scaled FP8 checkpoints
FP8_MAX = 448.0  # the largest finite float8_e4m3fn


@attrs.frozen
class BlockWeight:
    """A matrix kept in its GGUF blocks: ``blocks`` is ``uint8 [N, row_bytes]`` (whole
    blocks per row), ``shape`` the logical ``(N, K)`` it decodes to."""
    blocks: torch.Tensor
    format: str = attrs.field(validator=attrs.validators.in_(BLOCK_FORMATS))
    shape: tuple[int, int] = attrs.field(converter=tuple)

    def __attrs_post_init__(self):
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or \
                self.blocks.shape[0] != self.shape[0]:
            raise ValueError(f"{self.format} blocks of a {self.shape} weight must be uint8 "
                             f"[{self.shape[0]}, row_bytes]; got {self.blocks.dtype} "
                             f"{tuple(self.blocks.shape)}")


def gather_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0 rows ``uint8 [N, row_bytes]`` (whole runs of eight blocks) as Q8_0_G8 rows."""
    runs = _runs(blocks, "Q8_0")
    return torch.cat([runs[..., :2].flatten(2), runs[..., 2:].flatten(2)], 2).view(blocks.shape)


def scatter_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0_G8 rows as the Q8_0 rows they were gathered from."""
    runs = _runs(blocks, GATHERED).flatten(2)
    scales = runs[..., :2 * GATHERED_RUN].unflatten(2, (GATHERED_RUN, 2))
    quants = runs[..., 2 * GATHERED_RUN:].unflatten(2, (GATHERED_RUN, -1))
    return torch.cat([scales, quants], 3).view(blocks.shape)


def _runs(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """``[N, runs, 8, 34]`` (gathered: the same bytes, read in that shape)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % GATHERED_RUN_BYTES:
        raise ValueError(f"{name} rows to regather must be uint8 [N, row_bytes] of whole runs of "
                         f"{GATHERED_RUN_BYTES} bytes; got {blocks.dtype} {tuple(blocks.shape)}")
    return blocks.contiguous().view(blocks.shape[0], blocks.shape[1] // GATHERED_RUN_BYTES, GATHERED_RUN,
                                    Q8_0_BLOCK_BYTES)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``float8_e4m3fn [N, K]``, ``float32 [N]``) of a float weight: each row's largest
    magnitude maps to ``FP8_MAX``; an all-zero row gets scale 1. Runs once, at load."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"a weight to quantize must be a float [N, K]; got {w.dtype} "
                         f"{tuple(w.shape)}")
    amax = w.abs().amax(1).float() if w.shape[1] else w.new_zeros(w.shape[0], dtype=torch.float32)
    bad = (~torch.isfinite(amax)).nonzero()
    if len(bad):
        raise ValueError(f"a weight to quantize must be finite; row {int(bad[0])} holds "
                         f"{float(amax[bad[0]])}")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return to_fp8(w.float() / scale[:, None]), scale


def to_fp8(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, saturated at ``FP8_MAX`` (a quotient by a scale may round a
    hair past it; torch's conversion does not saturate)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
