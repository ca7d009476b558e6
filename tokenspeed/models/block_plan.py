"""Which layers of a GGUF model keep their weights in blocks, and the model built so.

A matrix stored in a block format a kernel reads (``tokenspeed.ir.weights.BLOCK_FORMATS``)
stays in its blocks: its layer becomes a ``BlockLinear`` (or ``BlockEmbedding``) over the
file's bytes. A stacked projection (``qkv_proj``, ``gate_up_proj``) keeps its blocks when
every part is stored in one format: its parts' block rows are stacked along N as their
float rows would be (rows are independent). Everything else is dequantized at load, and
one log line says which formats and stacked projections that was, with their counts.
A tied head reads the embedding's blocks.
"""

import collections
import logging

import attrs
from torch import nn

from tokenspeed.ir.weights import BLOCK_FORMATS
from tokenspeed.models.block_layers import BlockEmbedding, BlockLinear
from tokenspeed.models.gguf import hf_name, logical_shape
from tokenspeed.models.llama import STACKED, stacked_sizes

log = logging.getLogger(__name__)
EMBEDDING, HEAD = "model.embed_tokens", "lm_head"
STACKED_LAYERS = frozenset(stacked for stacked, _ in STACKED.values())


@attrs.frozen
class StoredMatrix:
    """A matrix as the file stores it: its format, logical ``(N, K)`` and bytes per row."""
    format: str
    shape: tuple[int, int]
    row_bytes: int


@attrs.frozen
class BlockPlan:
    """``layers``: our module name -> the format of its blocks (every part's); ``kept``: the
    checkpoint's names of the tensors read as blocks."""
    layers: dict[str, StoredMatrix]
    kept: frozenset[str]


def stored_matrices(reader) -> dict[str, StoredMatrix]:
    """Every 2-D tensor of a GGUF file, under its Hugging Face name."""
    return {hf_name(t.name): StoredMatrix(t.tensor_type.name, logical_shape(t), int(t.data.shape[-1]))
            for t in reader.tensors if len(t.shape) == 2}


def plan(model: nn.Module, stored: dict[str, StoredMatrix]) -> BlockPlan:
    """The layers of ``model`` (dense, on any device) whose every part is stored in one block
    format, at the shape the model expects (a wrong shape is left to the loader's check)."""
    parts = _parts_by_layer(model, stored)
    layers, kept = {}, set()
    for layer, names in parts.items():
        kept_matrix = _kept(model, layer, [stored[n] for n in names])
        if kept_matrix is not None:
            layers[layer] = kept_matrix
            kept.update(names)
    if model.config.tie_word_embeddings and EMBEDDING in layers:
        layers[HEAD] = layers[EMBEDDING]
    _log_dequantized(stored, parts, layers)
    return BlockPlan(layers, frozenset(kept))


def _parts_by_layer(model, stored) -> dict[str, list[str]]:
    """Our layer -> its checkpoint weights in stacking order (one for an unstacked layer)."""
    parts = collections.defaultdict(dict)
    for name in stored:
        layer, index = _layer_of(model, name)
        parts[layer][index] = name
    return {layer: [by_index[i] for i in sorted(by_index)] for layer, by_index in parts.items()}


def _layer_of(model, name: str) -> tuple[str, int]:
    """As the loader maps it: the layer of that name if the model has one (a KV-shared
    layer's own ``q_proj``), else the stacked projection it is a slice of."""
    module = name.removesuffix(".weight")
    base, _, part = module.rpartition(".")
    if _module(model, module) is not None or part not in STACKED:
        return module, 0
    stacked, index = STACKED[part]
    return f"{base}.{stacked}", index


def _kept(model, layer: str, parts: list[StoredMatrix]) -> StoredMatrix | None:
    formats = {p.format for p in parts}
    if len(formats) != 1 or not formats <= set(BLOCK_FORMATS):
        return None
    module = _module(model, layer)
    if module is None:
        return None
    stacked = layer.rpartition(".")[2]
    sizes = stacked_sizes(model.config, stacked) if stacked in STACKED_LAYERS else [module.weight.shape[0]]
    k = module.weight.shape[1]
    if [p.shape for p in parts] != [(n, k) for n in sizes] or len({p.row_bytes for p in parts}) != 1:
        return None
    return StoredMatrix(parts[0].format, (sum(sizes), k), parts[0].row_bytes)


def _module(model, layer: str) -> nn.Module | None:
    try:
        module = model.get_submodule(layer)
    except AttributeError:
        return None
    return module if isinstance(module, (nn.Linear, nn.Embedding)) else None


def _log_dequantized(stored, parts, layers) -> None:
    """One line: the quantized formats dequantized, by count, and the stacked projections
    whose parts mix formats."""
    unread = collections.Counter(m.format for m in stored.values()
                                 if m.format not in BLOCK_FORMATS + ("F32", "F16", "BF16"))
    mixed = [layer for layer, names in parts.items() if layer not in layers and len(names) > 1
             and {stored[n].format for n in names} <= set(BLOCK_FORMATS)]
    reasons = [f"{count} {fmt} tensors (no kernel reads {fmt})" for fmt, count in sorted(unread.items())]
    if mixed:
        reasons.append(f"{len(mixed)} stacked projections whose parts mix formats (the first: {mixed[0]})")
    if reasons:
        log.warning("GGUF weights dequantized at load: %s", "; ".join(reasons))


def swap_layers(model: nn.Module, block_plan: BlockPlan) -> nn.Module:
    """``model`` (on the meta device) with each planned layer a block layer."""
    for layer, matrix in block_plan.layers.items():
        parent, _, attr = layer.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, attr, _block_layer(getattr(owner, attr), matrix))
    return model


def _block_layer(dense: nn.Module, matrix: StoredMatrix) -> nn.Module:
    n, k = matrix.shape
    if isinstance(dense, nn.Embedding):
        return BlockEmbedding(n, k, matrix.row_bytes, matrix.format)
    return BlockLinear(k, n, matrix.row_bytes, matrix.format, bias=dense.bias is not None)
