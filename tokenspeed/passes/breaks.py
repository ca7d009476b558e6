"""Segment boundaries: a break around every attention op, and at every stage change.

Between attentions the work is token-shaped and capturable per bucket; attention itself
needs live metadata (lengths, tables) and runs eagerly in its own break segment.
"""

from tokenspeed.ir.ops import ATTENTION_TARGETS
from tokenspeed.ir.program import Program, copy_graph
from tokenspeed.passes.manager import program_pass


@program_pass("attention_breaks")
def attention_breaks(program: Program, **_) -> Program:
    gm = copy_graph(program.graph_module)
    segment, previous = -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if previous is None or _boundary(previous, node):
            segment += 1
        node.meta["segment"] = segment
        previous = node
    return program.evolve(graph_module=gm)


def _boundary(previous, node) -> bool:
    attention = previous.target in ATTENTION_TARGETS or node.target in ATTENTION_TARGETS
    return attention or previous.meta.get("stage") != node.meta.get("stage")


@program_pass("whole_graph")
def whole_graph(program: Program, **_) -> Program:
    """One segment for the whole step: attention runs inside the captured graph."""
    gm = copy_graph(program.graph_module)
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.meta["segment"] = 0
    return program.evolve(graph_module=gm)
