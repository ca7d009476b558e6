"""``merge_splits_in_launch``: a decode attention that splits each row's keys across
programs merges the splits in the launch that computes them, not in a second kernel (one
launch a layer fewer, issue 35's attention-with-its-combine fusion).

The last split of a row to finish does the merge, so the kernel needs a counter per row
and KV head that outlives the launch: ``attention_split_counters``, a zeroed int32 buffer
of the graph module shared by every layer (their launches run one after another, and each
leaves the counters zeroed). A CUDA graph replays with the same buffer. Kernels that do
not split (the CPU's reference) never read it.
"""

import torch
from torch import fx

from tokenspeed.ir.ops import DECODE_ATTENTION, ROPE_DECODE_ATTENTION
from tokenspeed.passes.manager import graph_pass

SPLIT_COUNTERS = "attention_split_counters"
SPLIT_COUNTER_SLOTS = 1 << 16   # rows x KV heads of the largest step that merges in one launch


@graph_pass("merge_splits_in_launch")
def merge_splits_in_launch(gm: fx.GraphModule, **_) -> None:
    attentions = [n for n in gm.graph.nodes if n.target in (DECODE_ATTENTION, ROPE_DECODE_ATTENTION)]
    if not attentions:
        return
    if not hasattr(gm, SPLIT_COUNTERS):
        gm.register_buffer(SPLIT_COUNTERS, torch.zeros(SPLIT_COUNTER_SLOTS, dtype=torch.int32,
                                                       device=_device(gm)))
    with gm.graph.inserting_before(attentions[0]):
        counters = gm.graph.get_attr(SPLIT_COUNTERS)
    for node in attentions:
        node.kwargs = {**node.kwargs, "split_counters": counters}


def _device(gm: fx.GraphModule) -> torch.device:
    """Where the model's weights are (a graph without any: the CPU)."""
    tensor = next(iter(gm.parameters()), None)
    tensor = next(iter(gm.buffers()), None) if tensor is None else tensor
    return torch.device("cpu") if tensor is None else tensor.device
