"""Fusions: fewer, larger kernels for a step that is launch- and bandwidth-bound (decode
takes them all; prefill, whose small steps are launch-bound too, the norms and the rotary).

- ``fuse_norms``: an ``rms_norm`` leaf module becomes ``tokenspeed::rms_norm``; when its input is a
  residual add, the add joins it (``tokenspeed::add_rms_norm`` returns norm and sum).
- ``fuse_rope_write_kv``: a layer's rotary of q and k and its cache write become one
  ``tokenspeed::rope_write_kv`` reading a cos/sin table.
- ``fuse_rope_decode_attention``: that op feeding the layer's decode attention joins it
  (``tokenspeed::rope_decode_attention``): the attention kernel rotates q and the row's
  own key and writes the cache itself.
- ``fuse_head_norms``: per-head RMSNorms of q and k (Qwen3's ``q_norm``, ``k_norm``) read
  by that op alone join it: the kernel normalises each head as it loads it, two launches
  a layer fewer.
- ``rope_kernels``: a rotary leaf left standing (DeepSeek's, which rotates its query's and
  key's rope parts apart from the cache write; a prefill layer the narrowing splits)
  becomes ``tokenspeed::rope`` over the shared table: one launch instead of a dozen ops.
- ``fuse_latent_write``: a latent layer's ``write_latent`` of a normed latent and a rotated
  rope key, each read by the write alone, becomes ``tokenspeed::norm_rope_write_latent``.
- ``fuse_moe_add``: a mixture's output added to its shared experts' (DeepSeek's layers)
  becomes one ``tokenspeed::moe`` that adds them as it combines the experts' rows.
- ``select_linear``: linear modules become ``tokenspeed::linear``, which picks the kernel
  by row count (split-K GEMV for a few rows on CUDA).
- ``fuse_gated_linear``: ``linear(silu_and_mul(gate_up))`` becomes
  ``tokenspeed::gated_linear``, whose GEMV computes the activation as it reads its input
  (a 16-bit or FP8 weight's; a GGUF weight's kernel runs the activation first).
- ``fuse_norm_linear``: a norm (with its residual add) whose only reader is a linear
  becomes ``tokenspeed::norm_linear``, whose GEMV normalises its input as it reads it
  (a 16-bit weight's; an FP8 weight's up to ``cuda.FP8_NORM_GEMV_MAX_WEIGHTS`` weights; a
  GGUF weight's up to ``cuda.GGUF_NORM_GEMV_MAX_N`` outputs); past the GEMV's rows, a
  per-channel FP8 weight's activation quantizer normalises the rows as it quantizes them.
- ``fuse_norm_route``: a norm (with its residual add) read by a router's ``route`` and
  after it (the mixture, the next layer) becomes ``tokenspeed::norm_route``, whose
  launch normalises the gate's input and stores the normed rows and their sum.
"""

import operator

import torch
from torch import fx

from tokenspeed.ir.ops import (DECODE_ATTENTION, MOE, NORM_ROUTE, OPS as ops, ROPE, ROPE_DECODE_ATTENTION, ROUTE,
                               WRITE_KV, WRITE_LATENT)
from tokenspeed.ir.program import rename
from tokenspeed.ir.rows import PROBE_ROWS, fake_values
from tokenspeed.ir.trace import leaf_kind
from tokenspeed.passes.manager import graph_pass

ROPE_TABLE = "rope_cos_sin"


def _module(gm: fx.GraphModule, node: fx.Node):
    return gm.get_submodule(node.target) if node.op == "call_module" else None


def _leaf(gm: fx.GraphModule, node: fx.Node, kind: str):
    """The leaf module ``node`` calls, if it computes ``kind``."""
    module = _module(gm, node)
    return module if module is not None and leaf_kind(module) == kind else None


@graph_pass("fuse_norms")
def fuse_norms(gm: fx.GraphModule, *, config, **_) -> None:
    values = fake_values(gm, config, PROBE_ROWS[0])
    for node in list(gm.graph.nodes):
        norm = _leaf(gm, node, "rms_norm")
        if norm is not None:
            x = node.args[0]
            residual_add = x.op == "call_function" and x.target is operator.add and \
                _same_tensor_type(values, x.args)
            new = _fused_add_norm(gm, x, norm, node) if residual_add else _norm(gm, x, norm, node)
            node.replace_all_uses_with(new[-1])
            name = node.name
            gm.graph.erase_node(node)
            rename(new[0], f"{name}_weight")
            rename(new[-1], name)
            _same_stage(node, *new)


def _same_tensor_type(values, args) -> bool:
    """A residual add: two tensors of one shape and dtype (no broadcast, no promotion)."""
    vals = [values.get(a.name) if isinstance(a, fx.Node) else None for a in args]
    return all(isinstance(v, torch.Tensor) for v in vals) and len(vals) == 2 and \
        vals[0].shape == vals[1].shape and vals[0].dtype == vals[1].dtype


def _norm(gm, x, norm, node) -> list[fx.Node]:
    with gm.graph.inserting_before(node):
        weight = gm.graph.get_attr(f"{node.target}.weight")
        return [weight, gm.graph.call_function(ops.rms_norm.default, (x, weight, norm.eps))]


def _fused_add_norm(gm, add, norm, node) -> list[fx.Node]:
    """At the add's place (its other users may precede the norm): norm and sum together."""
    with gm.graph.inserting_after(add):
        weight = gm.graph.get_attr(f"{node.target}.weight")
    with gm.graph.inserting_after(weight):
        fused = gm.graph.call_function(ops.add_rms_norm.default, (*add.args, weight, norm.eps))
    with gm.graph.inserting_after(fused):
        total = gm.graph.call_function(operator.getitem, (fused, 1))
    with gm.graph.inserting_after(total):
        normed = gm.graph.call_function(operator.getitem, (fused, 0))
    add.replace_all_uses_with(total)
    gm.graph.erase_node(add)
    rename(fused, f"{node.name}_with_residual")
    rename(total, add.name)
    return [weight, fused, total, normed]


@graph_pass("fuse_rope_write_kv")
def fuse_rope_write_kv(gm: fx.GraphModule, *, config, **_) -> None:
    """In prefill, where the narrowing rotates a layer's queries in the decoder stage (the
    view's rows) and writes its keys in the encoder (every row), that layer stays unfused."""
    table = None
    for write in [n for n in gm.graph.nodes if n.target == WRITE_KV]:
        k_rot, v, cache, layer, slots = write.args
        q_rot = _query_rotary(gm, k_rot)
        if q_rot is None or q_rot.meta.get("stage") != write.meta.get("stage"):
            continue
        table = table or _rope_table(gm, _module(gm, k_rot), config, write)
        with gm.graph.inserting_after(q_rot):
            fused = gm.graph.call_function(ops.rope_write_kv.default,
                                           (q_rot.args[0], k_rot.args[0], v, table, k_rot.args[1],
                                            cache, layer, slots), write.kwargs)   # the layer's KV scales
        q_rot.replace_all_uses_with(fused)
        rename(fused, f"{q_rot.name}_write_kv")
        _same_stage(write, fused)
        for dead in (write, q_rot, k_rot):
            gm.graph.erase_node(dead)


@graph_pass("fuse_rope_decode_attention")
def fuse_rope_decode_attention(gm: fx.GraphModule, **_) -> None:
    for node in list(gm.graph.nodes):
        rope = node.args[0] if node.target == DECODE_ATTENTION else None
        if not (isinstance(rope, fx.Node) and rope.target == ops.rope_write_kv.default
                and len(rope.users) == 1):
            continue
        q, k, v, table, positions, cache, layer, slots = rope.args
        _, cache_read, layer_read, block_tables, row_request, positions_read, scale, window = node.args
        if (cache_read, layer_read, positions_read, node.kwargs) != (cache, layer, positions, rope.kwargs):
            continue
        _substitute(gm, node, ROPE_DECODE_ATTENTION, (q, k, v, table, positions, cache, layer,
                                                     slots, block_tables, row_request, scale, window),
                    kwargs=node.kwargs)
        gm.graph.erase_node(rope)


@graph_pass("fuse_head_norms")
def fuse_head_norms(gm: fx.GraphModule, **_) -> None:
    for node in [n for n in gm.graph.nodes if n.target == ROPE_DECODE_ATTENTION]:
        q_norm, k_norm = (_lone_norm(arg) for arg in node.args[:2])
        if q_norm is not None and k_norm is not None and q_norm.args[2] != k_norm.args[2]:
            k_norm = None   # the kernel takes one eps
        fused = {name: norm for name, norm in (("q_norm", q_norm), ("k_norm", k_norm)) if norm is not None}
        if not fused:
            continue
        args = tuple(arg if norm is None else norm.args[0] for norm, arg in zip((q_norm, k_norm), node.args))
        kwargs = {**node.kwargs, **{name: norm.args[1] for name, norm in fused.items()},
                  "norm_eps": next(iter(fused.values())).args[2]}
        _substitute(gm, node, ROPE_DECODE_ATTENTION, args + node.args[2:], kwargs=kwargs)
        for norm in fused.values():
            gm.graph.erase_node(norm)


def _lone_norm(arg) -> fx.Node | None:
    """``arg`` if it is an ``rms_norm`` that only the attention reads."""
    return arg if isinstance(arg, fx.Node) and arg.target == ops.rms_norm.default and len(arg.users) == 1 else None


@graph_pass("rope_kernels")
def rope_kernels(gm: fx.GraphModule, *, config, **_) -> None:
    table = None
    for node in list(gm.graph.nodes):
        rotary = _leaf(gm, node, "rotary") or _leaf(gm, node, "mla_rotary")
        if rotary is not None:
            table = table or _rope_table(gm, rotary, config, node)
            x, positions = node.args
            _substitute(gm, node, ops.rope.default, (x, table, positions, rotary.interleaved))


@graph_pass("fuse_latent_write")
def fuse_latent_write(gm: fx.GraphModule, **_) -> None:
    for write in [n for n in gm.graph.nodes if n.target == WRITE_LATENT]:
        latent, key, cache, layer, slots = write.args
        rotated = key.args[0] if key.op == "call_method" and key.target == "view" else None
        parts = (latent, key, rotated)
        if not (latent.target == ops.rms_norm.default and getattr(rotated, "target", None) == ROPE
                and all(len(p.users) == 1 for p in parts)
                and len({p.meta.get("stage") for p in (*parts, write)}) == 1):
            continue
        x, weight, eps = latent.args
        k_rope, table, positions, interleaved = rotated.args
        with gm.graph.inserting_before(write):
            fused = gm.graph.call_function(ops.norm_rope_write_latent.default, (
                x, weight, eps, k_rope, table, positions, interleaved, cache, layer, slots))
        _same_stage(write, fused)
        for dead in (write, key, rotated, latent):
            gm.graph.erase_node(dead)


@graph_pass("fuse_moe_add")
def fuse_moe_add(gm: fx.GraphModule, *, config, **_) -> None:
    values = fake_values(gm, config, PROBE_ROWS[0])
    for add in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.add]:
        moe = next((a for a in add.args if isinstance(a, fx.Node) and a.target == MOE and len(a.users) == 1
                    and len(a.args) == 5 and not a.kwargs), None)
        if moe is not None and _same_tensor_type(values, add.args) and moe.meta.get("stage") == add.meta.get("stage"):
            shared = next(a for a in add.args if a is not moe)
            _substitute(gm, add, MOE, (*moe.args, shared))
            gm.graph.erase_node(moe)


@graph_pass("select_linear")
def select_linear(gm: fx.GraphModule, **_) -> None:
    for node in list(gm.graph.nodes):
        lin = _module(gm, node)
        if not isinstance(lin, torch.nn.Linear):
            continue
        with gm.graph.inserting_before(node):
            weight = gm.graph.get_attr(f"{node.target}.weight")
            bias = gm.graph.get_attr(f"{node.target}.bias") if lin.bias is not None else None
        _substitute(gm, node, ops.linear.default, (node.args[0], weight, bias))


@graph_pass("fuse_gated_linear")
def fuse_gated_linear(gm: fx.GraphModule, **_) -> None:
    for node in list(gm.graph.nodes):
        act = node.args[0] if node.target == ops.linear.default else None
        if not (isinstance(act, fx.Node) and act.target == ops.silu_and_mul.default
                and len(act.users) == 1):
            continue
        _substitute(gm, node, ops.gated_linear.default, (act.args[0], *node.args[1:]))
        gm.graph.erase_node(act)


@graph_pass("fuse_norm_linear")
def fuse_norm_linear(gm: fx.GraphModule, **_) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        norm = _feeding_norm(node, order)
        if norm is None:
            continue
        x, residual, weight, eps = _norm_operands(norm)
        with gm.graph.inserting_before(node):
            fused = gm.graph.call_function(ops.norm_linear.default,
                                           (x, residual, weight, eps, *node.args[1:]))
        rename(fused, f"{node.name}_normed")
        out = _substitute(gm, node, operator.getitem, (fused, 0))
        for part in _outputs(norm):  # the normed value (now unread) and the sum, if any
            if part.args[1] == 1:
                _substitute(gm, part, operator.getitem, (fused, 1), after=out)
            else:
                gm.graph.erase_node(part)
        gm.graph.erase_node(norm)


@graph_pass("fuse_norm_route")
def fuse_norm_route(gm: fx.GraphModule, **_) -> None:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for route in [n for n in gm.graph.nodes if n.target == ROUTE]:
        norm = _norm_routed(route, order)
        if norm is None:
            continue
        with gm.graph.inserting_before(route):
            fused = gm.graph.call_function(NORM_ROUTE, (*_norm_operands(norm), *route.args[1:]), dict(route.kwargs))
        rename(fused, f"{route.name}_normed")
        _same_stage(route, fused)
        route.replace_all_uses_with(fused)   # weights and ids come first in both
        gm.graph.erase_node(route)
        if norm.target == ops.rms_norm.default:
            _substitute(gm, norm, operator.getitem, (fused, 2), after=fused)
            continue
        for part in _outputs(norm):   # the normed value and the sum
            _substitute(gm, part, operator.getitem, (fused, 2 + part.args[1]), after=fused)
        gm.graph.erase_node(norm)


def _norm_routed(route: fx.Node, order) -> fx.Node | None:
    """The ``rms_norm``/``add_rms_norm`` whose normed value ``route`` reads, if every other
    reader of its outputs (the mixture, the next layer's residual) comes after ``route``."""
    normed = route.args[0]
    if not isinstance(normed, fx.Node):
        return None
    if normed.target == ops.rms_norm.default:
        norm, outputs = normed, [normed]
    elif normed.target is operator.getitem and normed.args[1] == 0 \
            and normed.args[0].target == ops.add_rms_norm.default:
        norm = normed.args[0]
        outputs = _outputs(norm)
    else:
        return None
    readers = [u for out in outputs for u in out.users if u is not route]   # a node this pass made: before
    return norm if all(order.get(r, -1) > order[route] for r in readers) else None


def _norm_operands(norm: fx.Node) -> tuple:
    """(x, residual or None, weight, eps) of an ``rms_norm`` or ``add_rms_norm``."""
    return norm.args if norm.target == ops.add_rms_norm.default else (norm.args[0], None, *norm.args[1:])


def _feeding_norm(linear: fx.Node, order) -> fx.Node | None:
    """The ``rms_norm``/``add_rms_norm`` whose normed value only ``linear`` reads, if its
    sum (when it has one) is read only after ``linear``, where the fused op produces it."""
    if linear.target != ops.linear.default or not isinstance(linear.args[0], fx.Node):
        return None
    normed = linear.args[0]
    if len(normed.users) != 1:
        return None
    if normed.target == ops.rms_norm.default:
        return normed
    fused = normed.args[0] if normed.target is operator.getitem and normed.args[1] == 0 else None
    if fused is None or fused.target != ops.add_rms_norm.default:
        return None
    readers = [u for out in _outputs(fused) for u in out.users if out is not normed]
    return fused if all(order[r] > order[linear] for r in readers) else None


def _outputs(node: fx.Node) -> list[fx.Node]:
    """The getitem nodes that unpack a multi-output op."""
    return [u for u in node.users if u.target is operator.getitem]


def _substitute(gm: fx.GraphModule, node: fx.Node, target, args,
                after: fx.Node | None = None, kwargs=None) -> fx.Node:
    """A call of ``target`` on ``args`` takes ``node``'s place, readers, name and stage;
    it goes before ``node``, or right after ``after`` where ``node`` comes too early."""
    with gm.graph.inserting_before(node) if after is None else gm.graph.inserting_after(after):
        new = gm.graph.call_function(target, args, kwargs)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    rename(new, node.name)
    _same_stage(node, new)
    return new


def _same_stage(original: fx.Node, *replacements: fx.Node) -> None:
    """New nodes run where the node they replace ran (prefill stages are set by then)."""
    if "stage" in original.meta:
        for node in replacements:
            if node.op != "placeholder":
                node.meta.setdefault("stage", original.meta["stage"])


def _query_rotary(gm, k_rot: fx.Node) -> fx.Node | None:
    """The rotary call of the same module on the query (same positions), if any."""
    if _leaf(gm, k_rot, "rotary") is None:
        return None
    for node in gm.graph.nodes:
        if node is not k_rot and node.target == k_rot.target and node.args[1] is k_rot.args[1]:
            return node
    return None


def _rope_table(gm: fx.GraphModule, rotary: torch.nn.Module, config, first_reader: fx.Node) -> fx.Node:
    """One shared cos/sin table over every position the model supports (read in the stage
    of its first reader)."""
    if not hasattr(gm, ROPE_TABLE):
        positions = torch.arange(config.max_position_embeddings, device=rotary.inv_freq.device)
        gm.register_buffer(ROPE_TABLE, rotary.cos_sin(positions))
    last_input = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last_input):
        table = gm.graph.get_attr(ROPE_TABLE)
    _same_stage(first_reader, table)
    return table
