"""Cut an annotated program into Segments with explicit inputs and outputs."""

import operator
from itertools import groupby

from torch import fx

from tokenspeed.ir.ops import ATTENTION_TARGETS, RECURRENT_TARGETS
from tokenspeed.ir.program import Program, Segment
from tokenspeed.ir.rows import rows_by_ladder
from tokenspeed.passes.manager import program_pass

EAGER_STAGES = ("narrowing", "finish")
LADDER_OF_STAGE = {"encoder": "tokens", "model": "tokens", "narrowing": "view", "decoder": "view",
                 "finish": "sampled", "decode": "batch"}


@program_pass("split_segments")
def split_segments(program: Program, *, config, **_) -> Program:
    graph = program.graph_module.graph
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    groups = [list(g) for _, g in groupby(body, key=lambda n: n.meta["segment"])]
    output = next(n for n in graph.nodes if n.op == "output")
    rows = rows_by_ladder(program.graph_module, config) if program.mode == "prefill" else {}
    segments = tuple(_segment(program, i, nodes, rows) for i, nodes in enumerate(groups))
    return program.evolve(segments=segments, output=output.args[0].name)


def _segment(program: Program, index: int, nodes: list[fx.Node], rows: dict[str, set[str]]) -> Segment:
    stage = nodes[0].meta.get("stage", "decode" if program.mode in ("decode", "verify") else "model")
    is_attention = any(n.target in ATTENTION_TARGETS for n in nodes) and len(nodes) == 1
    is_recurrent = any(n.target in RECURRENT_TARGETS for n in nodes) and len(nodes) == 1
    kind = "break" if is_attention or is_recurrent or stage in EAGER_STAGES else "graph"
    gm, inputs, outputs = _extract(program.graph_module, nodes)
    label = "attention" if is_attention else "recurrent" if is_recurrent else kind
    return Segment(name=f"{index:02d}.{stage}.{label}", kind=kind,
                   stage=stage, ladder=LADDER_OF_STAGE[stage], graph_module=gm,
                   inputs=inputs, outputs=outputs,
                   row_outputs=tuple(o for o in outputs if o in rows.get(LADDER_OF_STAGE[stage], ())))


def _input_view(node: fx.Node) -> bool:
    """A view of a graph input: a cache group's column of the stacked tables or slots."""
    return node.op == "call_function" and node.target is operator.getitem and \
        isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"


def _with_input_views(nodes: list[fx.Node]) -> list[fx.Node]:
    """``nodes`` with the views of graph inputs they read, and without those they do not:
    each segment computes its own, so a captured graph reads the pinned input itself,
    never another segment's output (which it would copy in)."""
    read = dict.fromkeys(i for n in nodes for i in n.all_input_nodes if _input_view(i))
    inside = set(nodes)
    return [*(v for v in read if v not in inside), *(n for n in nodes if not _input_view(n) or n in read)]


def _extract(root: fx.GraphModule, nodes: list[fx.Node]):
    nodes = _with_input_views(nodes)
    inside = set(nodes)
    inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in nodes if not _input_view(n) and any(u not in inside for u in n.users)]
    graph, env = fx.Graph(), {}
    for value in inputs:
        env[value] = graph.placeholder(value.name)
    for node in nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in outputs))
    return (fx.GraphModule(root, graph, class_name="Segment"),
            tuple(v.name for v in inputs), tuple(n.name for n in outputs))
