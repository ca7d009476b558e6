"""Segment boundaries: a break around every attention op, and at every stage change.

Between attentions the work is token-shaped and capturable per bucket; attention itself
needs live metadata (lengths, tables) and runs eagerly in its own break segment. A backend
whose attention reads metadata of shapes fixed by the bucket (a padded tile plan, a table
of fixed rows) is captured with it: then only the stages cut the program.
"""

from torch import fx

from tokenspeed.ir.ops import ATTENTION_TARGETS, RECURRENT_TARGETS
from tokenspeed.passes.manager import graph_pass


@graph_pass("attention_breaks")
def attention_breaks(gm: fx.GraphModule, **_) -> None:
    _number(gm, _boundary)


@graph_pass("stage_breaks")
def stage_breaks(gm: fx.GraphModule, **_) -> None:
    """One segment per stage: attention runs inside the captured graphs of its stage; a
    recurrent op, which reads its runs on the host, in a break of its own."""
    _number(gm, _stage_or_recurrent)


def _number(gm: fx.GraphModule, boundary) -> None:
    segment, previous = -1, None
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if previous is None or boundary(previous, node):
            segment += 1
        node.meta["segment"] = segment
        previous = node


def _boundary(previous, node) -> bool:
    attention = previous.target in ATTENTION_TARGETS or node.target in ATTENTION_TARGETS
    return attention or _stage_or_recurrent(previous, node)


def _stage_or_recurrent(previous, node) -> bool:
    return previous.target in RECURRENT_TARGETS or node.target in RECURRENT_TARGETS or \
        _stage_changes(previous, node)


def _stage_changes(previous, node) -> bool:
    return previous.meta.get("stage") != node.meta.get("stage")


@graph_pass("whole_graph")
def whole_graph(gm: fx.GraphModule, **_) -> None:
    """One segment for the whole step: attention runs inside the captured graph."""
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            node.meta["segment"] = 0
