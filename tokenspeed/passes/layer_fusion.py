"""``fuse_decode_layers``: a Llama decoder layer's decode ops become one
``tokenspeed::decode_layer``, which CUDA runs as one launch (``triton_layer``).

After the decode fusions a layer is five ops: ``norm_linear`` (QKV), ``rope_decode_attention``,
``linear`` (output projection), ``norm_linear`` (gate/up, with the residual add) and
``gated_linear`` (down), six or more kernels, each paying a launch and a round trip to
memory that a small model's step is made of. The pass matches that chain, read back from
the down projection; a layer that differs (a bias, a window, a head norm, a float8 scale, a
quantized weight, a shape the kernel's tiles do not hold) stays unfused, and the reason is
kept on its first op (``unfused=``, printed by ``inspect``).
"""

import functools
import operator
from typing import NamedTuple

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from tokenspeed.backends.kernels.layer_steps import layer_kernel_refuses
from tokenspeed.ir.ops import DECODE_LAYER, OPS as ops, ROPE_DECODE_ATTENTION
from tokenspeed.ir.program import rename
from tokenspeed.ir.weights import DENSE
from tokenspeed.passes.manager import graph_pass

NORM_LINEAR, LINEAR, GATED_LINEAR = ops.norm_linear.default, ops.linear.default, ops.gated_linear.default


@graph_pass("fuse_decode_layers")
def fuse_decode_layers(gm: fx.GraphModule, **_) -> None:
    for down in [n for n in gm.graph.nodes if n.target == GATED_LINEAR]:
        layer = _match(down)
        if layer is None:
            continue
        reason = _refusal(gm, layer)
        if reason is not None:
            layer.first.meta["unfused"] = reason
            continue
        _replace(gm, layer)


class _Layer(NamedTuple):
    """The matched chain, first op to last (the order they are defined in), and the
    normalized arguments of its ops."""
    nodes: list[fx.Node]
    args: dict

    @property
    def first(self) -> fx.Node:
        return self.nodes[0]


def _kwargs(node: fx.Node) -> dict:
    return normalize_function(node.target, node.args, node.kwargs, normalize_to_only_use_kwargs=True).kwargs


def _lone(node, target=None, index=None) -> bool:
    """``node`` has one reader, and calls ``target`` or is ``getitem(_, index)`` if given."""
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    if index is not None:
        return node.target is operator.getitem and node.args[1] == index
    return target is None or node.target == target


def _match(down: fx.Node) -> "_Layer | None":
    """Read back from the down projection; None where the chain is not a plain layer's."""
    mlp = _kwargs(down)
    gate_up_item = mlp["gate_up"]
    if not _lone(gate_up_item, index=0) or gate_up_item.args[0].target != NORM_LINEAR:
        return None
    post = gate_up_item.args[0]
    post_args = _kwargs(post)
    o_proj = post_args["residual"]
    if not _lone(o_proj, LINEAR):
        return None
    flat = _kwargs(o_proj)["x"]
    if not (_lone(flat) and flat.op == "call_method" and flat.target == "view"):
        return None
    attention = flat.args[0]
    if not _lone(attention, ROPE_DECODE_ATTENTION):
        return None
    att = _kwargs(attention)
    heads = [_head_view(att[name]) for name in ("q", "k", "v")]
    if None in heads or len({h[0] for h in heads}) != 1 or [h[1].args[1] for h in heads] != [0, 1, 2]:
        return None
    (_, _, q), (_, _, k), (_, _, v) = heads
    if k.args[2:] != v.args[2:] or q.args[3] != k.args[3]:   # k and v alike, one head_dim
        return None
    split = heads[0][0]
    qkv_item = split.args[0]
    if not (_lone(qkv_item, index=0) and qkv_item.args[0].target == NORM_LINEAR) or len(split.users) != 3:
        return None
    first = qkv_item.args[0]
    pre = _kwargs(first)
    total = [u for u in first.users if u.target is operator.getitem and u.args[1] == 1]
    if pre["residual"] is not None and not total:   # the sum unread: the MLP's input is something else
        return None
    h = total[0] if total else pre["x"]
    if post_args["x"] is not h or (total and len(total[0].users) != 1):
        return None
    nodes = [first, *total, qkv_item, split, *[item for _, item, _ in heads], *[view for _, _, view in heads],
             attention, flat, o_proj, post, gate_up_item, down]
    args = dict(pre=pre, post=post_args, att=att, o=_kwargs(o_proj), mlp=mlp,
                heads=(att["q"].args[2], att["k"].args[2]))
    return _Layer(nodes, args)


def _head_view(view) -> tuple | None:
    """``(split, item, view)`` for ``view(getitem(split(qkv), i), -1, heads, head_dim)``."""
    if not (isinstance(view, fx.Node) and view.op == "call_method" and view.target == "view"
            and len(view.args) == 4 and len(view.users) == 1):
        return None
    item = view.args[0]
    if not (_lone(item) and item.target is operator.getitem):
        return None
    split = item.args[0]
    if not (split.op == "call_method" and split.target == "split"):
        return None
    return split, item, view


def _refusal(gm: fx.GraphModule, layer: _Layer) -> str | None:
    a = layer.args
    pre, post, att, o, mlp = a["pre"], a["post"], a["att"], a["o"], a["mlp"]
    linears = (pre, post, o, mlp)
    if any(args.get("weight_format", DENSE) != DENSE for args in linears):
        return "a quantized weight"
    if any(args.get("bias") is not None for args in linears):
        return "a bias"
    if pre["eps"] != post["eps"]:
        return "two norm eps"
    if att["window"] != 0:
        return "a sliding window"
    if att.get("q_norm") is not None or att.get("k_norm") is not None:
        return "head norms"
    if (att.get("k_scale", 1.0), att.get("v_scale", 1.0)) != (1.0, 1.0):
        return "scaled (float8) keys"
    weights = [_tensor(gm, args["weight"]) for args in (pre, o, post, mlp)]
    if any(w is None or w.dtype not in (torch.float16, torch.bfloat16) for w in weights):
        return "weights not 16-bit"
    qkv, _, gate_up, down = weights
    num_heads, num_kv_heads = a["heads"]
    head_dim = qkv.shape[0] // (num_heads + 2 * num_kv_heads)
    return layer_kernel_refuses(down.shape[0], down.shape[1], num_heads, num_kv_heads, head_dim)


def _tensor(gm: fx.GraphModule, node) -> torch.Tensor | None:
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    return functools.reduce(getattr, node.target.split("."), gm)


def _replace(gm: fx.GraphModule, layer: _Layer) -> None:
    a = layer.args
    pre, post, att, o, mlp = a["pre"], a["post"], a["att"], a["o"], a["mlp"]
    down = layer.nodes[-1]
    args = (pre["x"], pre["residual"], pre["norm_weight"], pre["weight"], o["weight"], post["norm_weight"],
            post["weight"], mlp["weight"], pre["eps"], att["cos_sin"], att["positions"], att["kv_cache"],
            att["layer"], att["slot_mapping"], att["block_tables"], att["row_request"], att["scale"], *a["heads"])
    with gm.graph.inserting_after(down):
        fused = gm.graph.call_function(DECODE_LAYER, args, {"split_counters": mlp.get("split_counters")})
    with gm.graph.inserting_after(fused):
        residual = gm.graph.call_function(operator.getitem, (fused, 0))
    with gm.graph.inserting_after(residual):
        out = gm.graph.call_function(operator.getitem, (fused, 1))
    post_total = [u for u in layer.nodes[-3].users if u.target is operator.getitem and u.args[1] == 1]
    names = [(fused, f"layer{att['layer']}"), (out, down.name), *[(residual, t.name) for t in post_total]]
    for total in post_total:
        total.replace_all_uses_with(residual)
    down.replace_all_uses_with(out)
    for node in [*post_total, *reversed(layer.nodes)]:   # readers before what they read
        gm.graph.erase_node(node)
    for node, name in names:
        rename(node, name)
