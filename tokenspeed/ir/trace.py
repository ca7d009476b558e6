"""``ts.trace(model) -> Traced``: the first stage of the pipeline.

A custom FX tracer keeps norms and rotary embeddings as single calls and turns the
descriptor argument into one named placeholder per tensor leaf, so the IR says exactly
which metadata the model reads.
"""

import operator

import attrs
import torch
from torch import fx

from tokenspeed.backends.descriptors import ForwardMetadata, tensor_fields
from tokenspeed.ir.printing import graph_text
from tokenspeed.ir.program import rename
from tokenspeed.models.layers import RMSNorm, Rotary

LEAF_MODULES = (RMSNorm, Rotary)


class TokenspeedTracer(fx.Tracer):
    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return isinstance(m, LEAF_MODULES) or super().is_leaf_module(m, qualname)


@attrs.frozen
class Traced:
    """A traced model: ``forward(kv_cache, <metadata leaves>) -> logits of sampled rows``."""
    graph_module: fx.GraphModule
    config: object

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.graph_module.graph.nodes if n.op == "placeholder")

    def as_text(self) -> str:
        return graph_text(self.graph_module.graph)

    def __call__(self, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        leaves = {n: getattr(meta, n) for n in tensor_fields(ForwardMetadata)}
        return self.graph_module(kv_cache, **leaves)

    def __str__(self) -> str:
        return self.as_text()

    def lower(self, mode: str = "decode", **options):
        from tokenspeed.passes.lower import lower
        return lower(self, mode, **options)


def trace(model: torch.nn.Module) -> Traced:
    """Trace ``model.forward(kv_cache, meta)`` with ``meta`` a :class:`ForwardMetadata`."""
    names = tensor_fields(ForwardMetadata)
    meta = ForwardMetadata(**{n: fx.PH for n in names}, num_live_rows=0)
    graph = TokenspeedTracer().trace(model, concrete_args={"meta": meta})
    _flatten_signature(graph, names)
    _shorten_names(graph)
    _name_split_parts(graph)
    return Traced(fx.GraphModule(model, graph, class_name="Traced"), getattr(model, "config", None))


SHORTER = (("model_layers_", "layer"), ("_self_attn_", "_"), ("_mlp_", "_"), ("model_", ""),
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
