"""``merge_splits_in_launch``: a decode projection that splits its reduction across
programs (a GEMV's K, a router's gate) reduces the splits in the launch that computes them,
not in a second kernel: one launch fewer for each (a split GEMV's reduction, for a few rows
of a narrow projection; the router's choice, after its gate's product).

The last split to finish does the reduction, so the kernels need counters that outlive the
launch: ``split_counters``, a zeroed int32 buffer of the graph module handed to every
decode projection and route (their launches run one after another, and each leaves the
counters zeroed). A CUDA graph replays with the same buffer. Kernels that do not split (the
CPU's references) never read it. It runs after the fusions, on the ops they leave.

Decode attention is not handed the counters: with its KV splits merged by the last split
of each row and KV head, a step of the default model's shape took 4% longer on the H200 at
batch 1 (0.465 against 0.446 ms, docs/PERFORMANCE.md); its merge kernel is kept.
"""

import torch
from torch import fx

from tokenspeed.ir.ops import NORM_ROUTE, OPS as ops, ROUTE
from tokenspeed.passes.manager import graph_pass

SPLIT_COUNTERS = "split_counters"
SPLIT_COUNTER_SLOTS = 1 << 12   # column blocks of the widest projection that splits (a GEMV's)
SPLITTING = (ops.linear.default, ops.gated_linear.default, ops.norm_linear.default, ROUTE, NORM_ROUTE)


@graph_pass("merge_splits_in_launch")
def merge_splits_in_launch(gm: fx.GraphModule, **_) -> None:
    splitting = [n for n in gm.graph.nodes if n.target in SPLITTING]
    if not splitting:
        return
    if not hasattr(gm, SPLIT_COUNTERS):
        gm.register_buffer(SPLIT_COUNTERS, torch.zeros(SPLIT_COUNTER_SLOTS, dtype=torch.int32,
                                                       device=_device(gm)))
    with gm.graph.inserting_before(splitting[0]):
        counters = gm.graph.get_attr(SPLIT_COUNTERS)
    for node in splitting:
        node.kwargs = {**node.kwargs, "split_counters": counters}


def _device(gm: fx.GraphModule) -> torch.device:
    """Where the model's weights are (a graph without any: the CPU)."""
    tensor = next(iter(gm.parameters()), None)
    tensor = next(iter(gm.buffers()), None) if tensor is None else tensor
    return torch.device("cpu") if tensor is None else tensor.device
