"""The tracer: a model's ``forward(kv_cache, meta)`` as one FX graph.

A module whose class sets ``LEAF_ATTR`` (``ir_leaf = "rms_norm"``, say) stays one call in
the graph, so the IR reads as the model does and passes can find it by that name without
importing model classes. The descriptor argument becomes one named placeholder per
tensor leaf, so the IR says exactly which metadata the model reads.
"""

import operator

import torch
from torch import fx

from tokenspeed.ir.descriptors import ForwardMetadata, tensor_fields
from tokenspeed.ir.ops import MOE
from tokenspeed.ir.program import rename

LEAF_ATTR = "ir_leaf"
OPTIONAL_FIELDS = ("state_slots",)   # metadata only some models read: no input where unread


def leaf_kind(module: torch.nn.Module) -> str | None:
    """What a leaf module computes (``"rms_norm"``, ``"rotary"``), or None."""
    return getattr(module, LEAF_ATTR, None)


class TokenspeedTracer(fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return leaf_kind(m) is not None or super().is_leaf_module(m, qualname)


def trace_graph(model: torch.nn.Module) -> fx.GraphModule:
    """Trace ``model.forward(kv_cache, meta)`` with ``meta`` a :class:`ForwardMetadata`;
    the result is called with the cache and the descriptor's tensors as keywords."""
    names = tensor_fields(ForwardMetadata)
    meta = ForwardMetadata(**{n: fx.PH for n in names}, num_live_rows=0)
    graph = TokenspeedTracer().trace(model, concrete_args={"meta": meta})
    _flatten_signature(graph, names)
    _drop_unread(graph, OPTIONAL_FIELDS)
    _shorten_names(graph)
    _name_split_parts(graph)
    _name_moe_parts(graph)
    return fx.GraphModule(model, graph, class_name="Traced")


SHORTER = (("model_layers_", "layer"), ("_self_attn_", "_"), ("_linear_attn_", "_"), ("_mlp_", "_"), ("model_", ""),
           ("_default", ""))


def _shorten_names(graph: fx.Graph) -> None:
    """``model_layers_3_self_attn_q_proj`` reads as ``layer3_q_proj`` in the IR."""
    for node in graph.nodes:
        if node.op != "placeholder":
            short = node.name
            for long, replacement in SHORTER:
                short = short.replace(long, replacement)
            if short != node.name:
                rename(node, short)


def _name_split_parts(graph: fx.Graph) -> None:
    """``getitem(split(layer3_qkv_proj), 1)`` reads as ``layer3_k``."""
    for node in graph.nodes:
        split = node.args[0] if node.target is operator.getitem else None
        if split is not None and split.target == "split" and split.args[0].name.endswith("_qkv_proj"):
            rename(node, split.args[0].name.removesuffix("qkv_proj") + "qkv"[node.args[1]])


def _name_moe_parts(graph: fx.Graph) -> None:
    """``moe(x, layer3_experts_w13, ...)`` reads as ``layer3_moe``, the routing it reads as
    ``layer3_topk_weights`` and ``layer3_topk_ids``."""
    for node in graph.nodes:
        if node.target is MOE:
            _, w13, _, weights, ids = node.args
            layer = w13.name.removesuffix("experts_w13")
            for part, name in ((node, "moe"), (weights, "topk_weights"), (ids, "topk_ids")):
                rename(part, layer + name)


def _drop_unread(graph: fx.Graph, fields) -> None:
    """A model without recurrent layers reads no ``state_slots``: its IR names no such input."""
    for node in [n for n in graph.nodes if n.op == "placeholder" and n.name in fields and not n.users]:
        graph.erase_node(node)


def input_names(gm: fx.GraphModule) -> tuple[str, ...]:
    """The metadata fields a traced graph reads (its placeholders after the cache)."""
    return tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")[1:]


def _flatten_signature(graph: fx.Graph, leaf_names) -> None:
    """Name the pytree placeholders after their descriptor fields and drop the pytree
    calling convention: programs are called with flat keyword tensors."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, name in zip(placeholders[1:], leaf_names, strict=True):
        node.name = node.target = name
    graph._codegen = fx.graph.CodeGen()
    output = next(n for n in graph.nodes if n.op == "output")
    (result,) = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    output.args = (result,)
