"""Row narrowing: derive encoder / narrowing / decoder / finish stages from the graph.

A row-liveness analysis runs from the outputs back. The sampled-row gather needs only
the decoder view's rows; a cache write needs every row, as does a recurrent op (each
row reads the rows before it, and the op leaves the last row's state); a row-wise op needs what its
users need; a row-shaped op reading a row-dependent value that is not row-shaped (a
tuple from a split, a reshape that folds rows into another dimension) needs every row,
since such a value cannot be gathered. Values needed by every row form the encoder (run
over all tokens); values needed only on the view form the decoder (run over the view's
rows); each encoder value the decoder reads is gathered once, in the narrowing stage, by
``view_rows``.
"""

import enum

from torch import fx

from tokenspeed.ir.ops import RECURRENT_TARGETS, WRITE_KV_TARGETS
from tokenspeed.ir.program import STAGES, rename
from tokenspeed.ir.rows import row_shaped
from tokenspeed.passes.manager import graph_pass


class RowNeed(enum.IntEnum):
    """Which rows of a value its readers need, ordered: a value needs the most its readers do."""
    NONE = 0
    VIEW = 1
    ALL = 2


NONE, VIEW, ALL = RowNeed
ENCODER, NARROWING, DECODER, FINISH = STAGES


@graph_pass("narrow_rows")
def narrow_rows(gm: fx.GraphModule, *, config, **_) -> None:
    graph = gm.graph
    row_values = row_shaped(gm, config)
    gather = sample_gather(graph)
    recurrent = {n for n in graph.nodes if n.target in RECURRENT_TARGETS}
    need = row_needs(graph, row_values, gather, _ungatherable_readers(graph, row_values) | recurrent)
    stages = assign_stages(graph, row_values, need, gather)
    view_rows, view_samples = _add_view_inputs(graph)
    _insert_narrowing(graph, row_values, stages, view_rows)
    gather.replace_input_with(gather.args[2], view_samples)
    _order_by_stage(graph, stages)


def sample_gather(graph: fx.Graph) -> fx.Node:
    """The model's gather of ``sample_rows``: where the finish stage begins."""
    for node in graph.nodes:
        if node.target == "index_select" and getattr(node.args[2], "name", None) == "sample_rows":
            return node
    raise ValueError("cannot narrow: the model never gathers `sample_rows` (x.index_select(0, "
                     "meta.sample_rows)) before its head")


def row_needs(graph: fx.Graph, row_values: set[str], gather: fx.Node, forced=frozenset()) -> dict[fx.Node, int]:
    """How many rows of each row-shaped value are needed (``row_values``: the names of
    the row-shaped values); ``forced`` nodes need all."""
    need: dict[fx.Node, int] = {}
    for node in reversed(graph.nodes):
        if node in forced:
            need[node] = ALL
        elif node.name in row_values:
            need[node] = max((_need_from(u, need, row_values, gather) for u in node.users), default=NONE)
    return need


def _ungatherable_readers(graph: fx.Graph, row_values: set[str]) -> set[fx.Node]:
    """Row-shaped nodes that read a row-dependent value which is not row-shaped."""
    dependent: set[fx.Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name in row_values) or \
                any(i in dependent for i in node.all_input_nodes):
            dependent.add(node)
    return {n for n in dependent if n.name in row_values and
            any(i in dependent and i.name not in row_values for i in n.all_input_nodes)}


def _need_from(user: fx.Node, need, row_values, gather) -> int:
    if user.target in WRITE_KV_TARGETS or user.target in RECURRENT_TARGETS:
        return ALL
    if user is gather:
        return VIEW
    if user.name in row_values:
        return need[user]
    return ALL  # a consumer that is not row-wise may read every row


def assign_stages(graph, row_values, need, gather) -> dict[fx.Node, str]:
    stages: dict[fx.Node, str] = {}
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        inputs = [stages[i] for i in node.all_input_nodes if i in stages]
        if node is gather or FINISH in inputs:
            stages[node] = FINISH
        elif node.name in row_values:
            stages[node] = ENCODER if need[node] == ALL else DECODER
        else:
            stages[node] = max(inputs, key=STAGES.index, default=ENCODER)
        node.meta["stage"] = stages[node]
    return stages


def _add_view_inputs(graph: fx.Graph) -> tuple[fx.Node, fx.Node]:
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        view_samples = graph.placeholder("view_sample_rows")
    with graph.inserting_after(last):
        view_rows = graph.placeholder("view_rows")
    return view_rows, view_samples


def _insert_narrowing(graph, row_values, stages, view_rows) -> None:
    """Gather every encoder-side row value that a decoder or finish node reads."""
    for value in list(graph.nodes):
        if value.name not in row_values or stages.get(value, ENCODER) != ENCODER:
            continue
        readers = [u for u in value.users if stages.get(u) in (DECODER, FINISH)]
        if not readers:
            continue
        with graph.inserting_after(value):
            narrowed = graph.call_method("index_select", (value, 0, view_rows))
        rename(narrowed, f"narrow_{value.name}")
        narrowed.meta["stage"] = stages[narrowed] = NARROWING
        for reader in readers:
            reader.replace_input_with(value, narrowed)


def _order_by_stage(graph: fx.Graph, stages) -> None:
    output = next(n for n in graph.nodes if n.op == "output")
    ordered = sorted(stages, key=lambda n: STAGES.index(stages[n]))  # stable: keeps node order
    for node in ordered:
        output.prepend(node)
