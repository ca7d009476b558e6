"""Which layers of a GGUF model keep their weights in blocks, and the model built so.

A matrix stored in a block format a kernel reads (``tokenspeed.ir.weights.BLOCK_FORMATS``)
stays in its blocks: its layer becomes a ``BlockLinear`` (or ``BlockEmbedding``) over the
file's bytes. A stacked projection (``qkv_proj``, ``gate_up_proj``) whose parts share one
format stacks their block rows along N as their float rows would be (rows are
independent); parts of several block formats stay separate layers (``BlockLinearParts``).
Everything else is dequantized at load, and one log line names those formats with their
tensors' counts. A tied head reads the embedding's blocks.
"""

import collections
import logging

import attrs
from torch import nn

from tokenspeed.ir.weights import BLOCK_FORMATS
from tokenspeed.models.block_layers import BlockEmbedding, BlockLinear, BlockLinearParts
from tokenspeed.models.gguf import hf_name, logical_shape
from tokenspeed.models.layer_swap import (EMBEDDING, HEAD, layer_module, part_sizes, parts_by_layer,
                                          replace_layer)

log = logging.getLogger(__name__)


@attrs.frozen
class StoredMatrix:
    """A matrix as the file stores it: its format, logical ``(N, K)`` and bytes per row."""
    format: str
    shape: tuple[int, int]
    row_bytes: int


@attrs.frozen
class BlockPlan:
    """``layers``: our layer's name -> its blocks (every part's, stacked); ``split_layers``:
    a stacked projection's name -> its parts' blocks by checkpoint part name (``q_proj``),
    in stacking order; ``kept``: the checkpoint's names of the tensors read as blocks."""
    layers: dict[str, StoredMatrix]
    split_layers: dict[str, dict[str, StoredMatrix]]
    kept: frozenset[str]


def stored_matrices(reader) -> dict[str, StoredMatrix]:
    """Every 2-D tensor of a GGUF file, under its Hugging Face name."""
    return {hf_name(t.name): StoredMatrix(t.tensor_type.name, logical_shape(t), int(t.data.shape[-1]))
            for t in reader.tensors if len(t.shape) == 2}


def plan(model: nn.Module, stored: dict[str, StoredMatrix]) -> BlockPlan:
    """The layers of ``model`` (dense, on any device) whose every part is stored in a block
    format, at the shape the model expects (a wrong shape is left to the loader's check, and
    not logged as dequantized: the loader refuses it)."""
    layers, split_layers, kept, misshapen = {}, {}, set(), set()
    for layer, names in parts_by_layer(model, stored).items():
        parts = [stored[n] for n in names]
        if not _readable(model, layer, parts):
            continue
        if not _shaped(model, layer, parts):
            misshapen.update(names)
            continue
        if len({(p.format, p.row_bytes) for p in parts}) == 1:
            layers[layer] = _stacked(parts)
        else:
            split_layers[layer] = {_part_name(n): p for n, p in zip(names, parts)}
        kept.update(names)
    if model.config.tie_word_embeddings and EMBEDDING in layers:
        layers[HEAD] = layers[EMBEDDING]
    _log_dequantized(stored, kept | misshapen)
    return BlockPlan(layers, split_layers, frozenset(kept))


def _stacked(parts: list[StoredMatrix]) -> StoredMatrix:
    """Parts of one format as one matrix: their block rows one after another."""
    first = parts[0]
    return StoredMatrix(first.format, (sum(p.shape[0] for p in parts), first.shape[1]), first.row_bytes)


def _part_name(name: str) -> str:
    """``model.layers.0.self_attn.q_proj.weight`` -> ``q_proj``."""
    return name.removesuffix(".weight").rpartition(".")[2]


def _readable(model, layer: str, parts: list[StoredMatrix]) -> bool:
    """A layer of the model whose every part is in a block format."""
    return layer_module(model, layer) is not None and {p.format for p in parts} <= set(BLOCK_FORMATS)


def _shaped(model, layer: str, parts: list[StoredMatrix]) -> bool:
    """Every part of the shape the model's layer expects."""
    width = layer_module(model, layer).weight.shape[1]
    return [p.shape for p in parts] == [(n, width) for n in part_sizes(model, layer)]


def _log_dequantized(stored, kept) -> None:
    """One line naming the quantized formats dequantized, with their tensors' counts."""
    unread = collections.Counter(m.format for name, m in stored.items()
                                 if name not in kept and m.format not in ("F32", "F16", "BF16"))
    if unread:
        log.warning("GGUF weights dequantized at load: %s", ", ".join(
            f"{count} {fmt} tensors" + (" (in a layer with a part no kernel reads)" if fmt in BLOCK_FORMATS
                                        else f" (no kernel reads {fmt})")
            for fmt, count in sorted(unread.items())))


def swap_layers(model: nn.Module, block_plan: BlockPlan) -> nn.Module:
    """``model`` (on the meta device) with each planned layer a block layer."""
    for layer, matrix in block_plan.layers.items():
        replace_layer(model, layer, lambda dense, m=matrix: _block_layer(dense, m))
    for layer, parts in block_plan.split_layers.items():
        replace_layer(model, layer, lambda dense, p=parts: BlockLinearParts(
            {name: _block_layer(dense, m) for name, m in p.items()}))
    return model


def _block_layer(dense: nn.Module, matrix: StoredMatrix) -> nn.Module:
    n, k = matrix.shape
    if isinstance(dense, nn.Embedding):
        return BlockEmbedding(n, k, matrix.row_bytes, matrix.format)
    return BlockLinear(k, n, matrix.row_bytes, matrix.format, bias=dense.bias is not None)
