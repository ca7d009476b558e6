"""Kernel selection. Decode attention has one query row per request, so decode lowering
swaps the general ragged attention for the split-K decode kernel, and latent attention for
its absorbed form. Prefill attention reads
the step's tile plan, built once with the rest of its metadata (``plan_extend``), where
the general op would plan on the device in every layer; an attention the narrowing put
in the decoder stage runs over the decoder view, and reads the view's plan."""

from torch import fx

from tokenspeed.ir.ops import (ATTENTION, CAUSAL_CONV_SILU, DECODE_ATTENTION, EXTEND_ATTENTION, GATED_DELTA_RULE,
                               MLA_ATTENTION, MLA_DECODE_ATTENTION, OPS)
from tokenspeed.ir.program import STAGES, rename
from tokenspeed.passes.manager import graph_pass

_, _, DECODER, _ = STAGES
DECODE_FORMS = {ATTENTION: DECODE_ATTENTION, MLA_ATTENTION: MLA_DECODE_ATTENTION}


@graph_pass("decode_kernels")
def decode_kernels(gm: fx.GraphModule, **_) -> None:
    for node in gm.graph.nodes:
        if node.target in DECODE_FORMS:
            node.target = DECODE_FORMS[node.target]
            rename(node, node.name.replace("attention", "decode_attention"))


@graph_pass("recurrent_steps")
def recurrent_steps(gm: fx.GraphModule, **_) -> None:
    """Decode's recurrent ops in their one-row-a-request forms (``causal_conv_silu_step``,
    ``gated_delta_rule_step``): each row continues its own slot, and nothing is read on the
    host, so the step is captured. (A verify window holds several rows of a request: its
    ops keep the run forms.)"""
    steps = {CAUSAL_CONV_SILU: OPS.causal_conv_silu_step.default, GATED_DELTA_RULE: OPS.gated_delta_rule_step.default}
    for node in gm.graph.nodes:
        if node.target in steps:
            *inputs, state_slots, _row_request, positions = node.args
            node.target, node.args = steps[node.target], (*inputs, state_slots, positions)
            rename(node, f"{node.name}_step")


@graph_pass("extend_kernels")
def extend_kernels(gm: fx.GraphModule, **_) -> None:
    graph, tiles = gm.graph, {}
    for node in list(graph.nodes):
        if node.target == ATTENTION:
            name = "view_attention_tiles" if node.meta.get("stage") == DECODER else "attention_tiles"
            if name not in tiles:
                tiles[name] = _placeholder(graph, name)
            q, kv_cache, layer, block_tables, row_request, positions, scale, window = node.args
            node.target = EXTEND_ATTENTION
            node.args = (q, kv_cache, layer, block_tables, row_request, positions, tiles[name], scale, window)
            rename(node, node.name.replace("attention", "extend_attention"))


def _placeholder(graph: fx.Graph, name: str) -> fx.Node:
    with graph.inserting_after([n for n in graph.nodes if n.op == "placeholder"][-1]):
        return graph.placeholder(name)
