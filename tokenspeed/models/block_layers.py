"""Layers whose weight stays in its GGUF blocks: a linear layer and an embedding table.

Each holds its blocks as a frozen ``uint8 [N, row_bytes]`` parameter named ``weight`` (so
checkpoint names, ties and device moves work as for a dense layer; a dtype cast leaves
integer parameters alone) and calls the IR op with the weight's format, so the traced
graph shows ``tokenspeed::linear`` / ``tokenspeed::embedding`` and the backend picks the
kernel that reads the format.
"""

from collections.abc import Collection

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.ir.weights import BLOCK_FORMATS, GATHERED, GATHERED_RUN_BYTES, WIDE_ROWS, gather_scales
from tokenspeed.models.layer_swap import HEAD


def _blocks(rows: int, row_bytes: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(rows, row_bytes, dtype=torch.uint8), requires_grad=False)


def _check_format(weight_format: str) -> str:
    if weight_format not in BLOCK_FORMATS:
        raise ValueError(f"weight format {weight_format!r} is not a block format; "
                         f"block formats: {', '.join(BLOCK_FORMATS)}")
    return weight_format


class BlockLinear(nn.Module):
    """``x @ dequantize(weight).T + bias`` with ``weight`` in ``weight_format``'s blocks."""

    def __init__(self, in_features: int, out_features: int, row_bytes: int, weight_format: str,
                 bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_format = _check_format(weight_format)
        self.weight = _blocks(out_features, row_bytes)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias, self.weight_format)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.weight_format}, bias={self.bias is not None}")


class BlockLinearParts(nn.Module):
    """A stacked projection whose parts are stored in different block formats (a Q4_K_M
    file's Q4_K queries beside Q6_K values): each part its own ``BlockLinear``, named as
    the checkpoint names it, the outputs concatenated. Block rows of two formats cannot
    share one tensor; the layer stays unfused rather than dequantized."""

    def __init__(self, parts: dict[str, BlockLinear]):
        super().__init__()
        self.part_names = tuple(parts)
        for name, layer in parts.items():
            setattr(self, name, layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([getattr(self, name)(x) for name in self.part_names], dim=-1)


class BlockEmbedding(nn.Module):
    """Rows of a table kept in blocks, decoded in the model's dtype as they are gathered.

    The table's parameter is integer, so the model's dtype is followed separately: every
    cast of the module (``model.to(dtype)``) is applied to a witness of that dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, row_bytes: int,
                 weight_format: str, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight_format = _check_format(weight_format)
        self.weight = _blocks(num_embeddings, row_bytes)
        self.dtype = dtype

    def _apply(self, fn, recurse=True):
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return super()._apply(fn, recurse)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.embedding(ids, self.weight, self.weight_format, self.embedding_dim, self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight_format}"


def gather_q8_0_scales(model: nn.Module, names: Collection[str] | None = None) -> nn.Module:
    """``model`` with its Q8_0 block layers named in ``names`` (every one when None) whose
    rows are whole runs of eight blocks regathered in place as Q8_0_G8 (``gguf_blocks``:
    each block's quants 16-byte aligned, the same bytes); a layer holding a regathered
    layer's tensor (a tied table) is marked so, the tensor regathered once."""
    gathered = set()
    for name, module in model.named_modules():
        if ((names is None or name in names) and getattr(module, "weight_format", None) == "Q8_0"
                and module.weight.shape[1] % GATHERED_RUN_BYTES == 0 and id(module.weight) not in gathered):
            module.weight.data = gather_scales(module.weight.data)
            gathered.add(id(module.weight))
    for module in model.modules():
        if id(getattr(module, "weight", None)) in gathered:
            module.weight_format = GATHERED
    return model


def gather_q8_0_head(model: nn.Module) -> nn.Module:
    """``model`` (on a GPU) with a Q8_0 output head of ``WIDE_ROWS`` rows or more (and its
    table, when tied) regathered: its one-row product is the wide GEMV's, 0.61x the file's
    blocks' time on an H100. The other weights keep the file's blocks: the unit GEMV's K
    splits (narrow ones) or a decode batch's tensor-core matmul (a gate/up: 1.3x the time
    at 32 rows) read them faster (PERFORMANCE.md, 2026-12-06, forty-ninth session)."""
    head = getattr(model, HEAD, None)
    if head is None or getattr(head, "weight", None) is None or head.weight.shape[0] < WIDE_ROWS:
        return model
    return gather_q8_0_scales(model, names={HEAD})
