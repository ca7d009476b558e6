"""IR types after tracing: a Program is an annotated graph, later cut into Segments.

Every pass returns a new Program; the graph is copied, never edited in place, so each
entry of a lowering's history stays valid and printable.
"""

import attrs
import torch
from torch import fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module

from tokenspeed.ir.descriptors import leaves
from tokenspeed.ir.printing import graph_text

STAGES = ("encoder", "narrowing", "decoder", "finish")
ANNOTATIONS = ("stage", "segment")


@attrs.frozen
class Segment:
    """A sub-graph with explicit inputs and outputs.

    ``kind`` is ``"graph"`` (captured, one graph per rung of its ladder) or ``"break"``
    (run eagerly with live metadata). ``ladder`` names the ladder that pads its rows:
    ``"tokens"`` (prefill token buckets), ``"view"`` (decoder-view buckets), ``"sampled"``
    (the sampled rows: never padded) or ``"batch"`` (the decode batch ladder).
    ``row_outputs`` (prefill, whose eager segments run on padded buckets): the outputs with
    a row per row of the segment's ladder, whose padded rows an eager run zeroes; the
    others (weights passed on, values of the weights alone, rows of the other ladder) are
    never touched, whatever their leading dimension. A decode or verify segment is never
    zeroed and names none.
    """
    name: str
    kind: str
    stage: str
    ladder: str
    graph_module: fx.GraphModule = attrs.field(repr=False, eq=False)
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    row_outputs: tuple[str, ...] = ()

    def __call__(self, env: dict) -> None:
        values = self.graph_module(*[env[name] for name in self.inputs])
        env.update(zip(self.outputs, values))

    def as_text(self) -> str:
        head = f"segment {self.name} [{self.kind}, stage={self.stage}, ladder={self.ladder}]"
        return f"{head}({', '.join(self.inputs)}) -> ({', '.join(self.outputs)})\n" + \
            graph_text(self.graph_module.graph)


@attrs.frozen
class Program:
    mode: str
    graph_module: fx.GraphModule = attrs.field(repr=False, eq=False)
    segments: tuple[Segment, ...] = ()
    output: str = ""

    def as_text(self) -> str:
        if self.segments:
            return "\n\n".join(s.as_text() for s in self.segments) + f"\n\nreturn %{self.output}"
        return graph_text(self.graph_module.graph, ANNOTATIONS)

    def evolve(self, **changes) -> "Program":
        return attrs.evolve(self, **changes)

    def __call__(self, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """Run every segment eagerly, in order: the reference for any captured run."""
        env = {"kv_cache": kv_cache, **leaves(meta)}
        for segment in self.segments:
            segment(env)
        return env[self.output]


def copy_graph(gm: fx.GraphModule, lazy: bool = True) -> fx.GraphModule:
    """A new GraphModule over the same weights with a copied graph (node meta included).
    ``lazy``: its Python code is generated when it is first called, not now: most of a
    lowering's programs are only read and printed, and the code generation took a third of
    a lowering. A module whose ``forward`` is kept and called directly is made eager (a
    lazy one's ``forward`` stays a wrapper that recompiles on the first call, then calls
    the module: twice the host time a call)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    graph._codegen = gm.graph._codegen
    with _use_lazy_graph_module(lazy):
        return _make_graph_module(gm, graph, class_name=type(gm).__name__)


def rename(node: fx.Node, name: str) -> None:
    """Give ``node`` a readable name, unique among the graph's live nodes (a suffix if a
    live node holds it), and reserved so that nodes created later cannot take it."""
    namespace = node.graph._graph_namespace
    if any(n.name == name for n in node.graph.nodes if n is not node):
        name = namespace.create_name(name, None)
    node.name = name
    namespace._used_names.add(name)
