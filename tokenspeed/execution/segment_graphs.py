"""Captured graphs of prefill segments, one per (segment, rung of its ladder).

A graph replays over the tensors it was captured with. Slot views, the cache and earlier
graphs' outputs are read in place, the first two pinned (a replay over other tensors is
an error); any other input is copied into the graph's own static tensor before a replay.
"""

import attrs
import torch

from tokenspeed.ir.program import Segment
from tokenspeed.execution.graphs import Captured, MovedTensorError, state_tensors


@attrs.frozen
class SegmentGraph:
    graph: Captured
    static_inputs: dict[str, torch.Tensor]
    pinned: tuple[str, ...]


class SegmentGraphs:
    """``(segment name, rung) -> SegmentGraph``, in capture order."""

    def __init__(self, pinned_inputs: tuple[str, ...]):
        self.pinned_inputs = pinned_inputs
        self.graphs: dict[tuple[str, int], SegmentGraph] = {}

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self.graphs

    def __iter__(self):
        return iter(self.graphs)

    def capture(self, capturer, seg: Segment, rung: int, env: dict, stable: set[int],
                sources) -> tuple[torch.Tensor, ...]:
        """Capture ``seg`` over ``env``'s values (those in ``stable`` by address, others
        cloned); ``sources(names)`` says where the pinned inputs live now, for the guard."""
        static = {n: env[n] if id(env[n]) in stable else env[n].clone() for n in seg.inputs}
        pinned = tuple(n for n in seg.inputs if n in self.pinned_inputs)
        graph = capturer.capture(f"prefill[{seg.name}, rung={rung}]",
                                 lambda: seg.graph_module(*[static[n] for n in seg.inputs]),
                                 reach=lambda: {**static, **sources(pinned),
                                                **state_tensors(seg.graph_module)})
        self.graphs[seg.name, rung] = SegmentGraph(graph, static, pinned)
        return graph.outputs

    def replay(self, seg: Segment, rung: int, env: dict) -> tuple[torch.Tensor, ...]:
        entry = self.graphs[seg.name, rung]
        for name in seg.inputs:
            if env[name] is entry.static_inputs[name]:
                continue
            if name in entry.pinned:
                raise MovedTensorError(f"graph {entry.graph.name}: input {name!r} is no longer "
                                       "the tensor it was captured over")
            entry.static_inputs[name].copy_(env[name])
        return entry.graph.replay()
