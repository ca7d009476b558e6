"""Kernel selection: decode attention has one query row per request, so decode lowering
swaps the general ragged attention for the split-K decode kernel."""

from tokenspeed.ir.ops import ATTENTION, DECODE_ATTENTION
from tokenspeed.ir.program import Program, copy_graph, rename
from tokenspeed.passes.manager import program_pass


@program_pass("decode_kernels")
def decode_kernels(program: Program, **_) -> Program:
    gm = copy_graph(program.graph_module)
    for node in gm.graph.nodes:
        if node.target == ATTENTION:
            node.target = DECODE_ATTENTION
            rename(node, node.name.replace("attention", "decode_attention"))
    gm.recompile()
    return program.evolve(graph_module=gm)
