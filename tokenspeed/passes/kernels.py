"""Kernel selection: decode attention has one query row per request, so decode lowering
swaps the general ragged attention for the split-K decode kernel."""

from torch import fx

from tokenspeed.ir.ops import ATTENTION, DECODE_ATTENTION
from tokenspeed.ir.program import rename
from tokenspeed.passes.manager import graph_pass


@graph_pass("decode_kernels")
def decode_kernels(gm: fx.GraphModule, **_) -> None:
    for node in gm.graph.nodes:
        if node.target == ATTENTION:
            node.target = DECODE_ATTENTION
            rename(node, node.name.replace("attention", "decode_attention"))
