"""``fuse_router``: a router's gate product and its choice (``softmax_top_k``, or DeepSeek's
``group_top_k``) become one ``route`` op, which a decode step runs in one launch
(``triton_route.route``): one launch a mixture layer fewer for a 16-bit gate (Qwen3-MoE,
Mixtral), two for DeepSeek's float32 gate, whose cast of the layer's input was a kernel of
its own.

Two gates are taken: a dense ``linear`` op without a bias, read by the choice alone; and
``torch.linear`` of the input cast to float32 and the gate's weight (cast or not), which
keeps its float32 logits (``logits_dtype``). Other logits stay as they are.
"""

import torch
from torch import fx

from tokenspeed.ir.ops import GROUP_TOP_K, OPS as ops, ROUTE, SOFTMAX_TOP_K
from tokenspeed.ir.program import rename
from tokenspeed.passes.manager import graph_pass

TORCH_LINEAR = torch.nn.functional.linear


@graph_pass("fuse_router")
def fuse_router(gm: fx.GraphModule, **_) -> None:
    for choice in [n for n in gm.graph.nodes if n.target in (SOFTMAX_TOP_K, GROUP_TOP_K)]:
        gate = choice.args[0]
        operands = _gate_operands(gate)
        if operands is None:
            continue
        x, weight, logits_dtype = operands
        kwargs = {} if logits_dtype is None else {"logits_dtype": logits_dtype}
        with gm.graph.inserting_before(choice):
            args, grouping = _route_args(choice)
            fused = gm.graph.call_function(ROUTE, (x, weight, *args), {**kwargs, **grouping})
        if "stage" in choice.meta:
            fused.meta["stage"] = choice.meta["stage"]
        choice.replace_all_uses_with(fused)
        casts = [a for a in gate.args if isinstance(a, fx.Node) and a.op == "call_method"]
        for node in (choice, gate, *casts):
            if not node.users:
                gm.graph.erase_node(node)
        rename(fused, f"{weight.name.removesuffix('_weight')}_route")


def _route_args(choice: fx.Node) -> tuple[tuple, dict]:
    """``route``'s (k, normalize, scale) and grouping keywords from a ``softmax_top_k`` or
    ``group_top_k`` node."""
    if choice.target == SOFTMAX_TOP_K:
        return choice.args[1:], {}
    _, bias, k, n_group, topk_group, method, normalize, scale = choice.args
    grouping = dict(n_group=n_group, topk_group=topk_group, method=method)
    return (k, normalize, scale), grouping if bias is None else {**grouping, "correction_bias": bias}


def _gate_operands(gate) -> tuple[fx.Node, fx.Node, torch.dtype | None] | None:
    """(input, weight, logits dtype) of a gate this pass takes, read by its choice alone."""
    if not isinstance(gate, fx.Node) or len(gate.users) != 1 or gate.kwargs:
        return None
    if gate.target == ops.linear.default and len(gate.args) == 3 and gate.args[2] is None:
        return gate.args[0], gate.args[1], None
    if gate.target is TORCH_LINEAR and len(gate.args) == 2:
        x, weight = (_float_cast(a) for a in gate.args)
        weight = weight or gate.args[1]
        if x is not None and weight.op == "get_attr":
            return x, weight, torch.float32
    return None


def _float_cast(node) -> fx.Node | None:
    """What ``node`` casts with ``.float()``, if it is such a cast read once."""
    fits = isinstance(node, fx.Node) and node.op == "call_method" and node.target == "float" \
        and len(node.args) == 1 and not node.kwargs and len(node.users) == 1
    return node.args[0] if fits else None
