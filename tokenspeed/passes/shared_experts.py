"""``fuse_shared_experts``: a mixture whose shared experts' output it adds (``fuse_moe_add``)
takes their weights instead, and runs their MLP in its own launches where it can (a decode
step of a few tokens: ``triton_moe_pairs``), two launches a layer fewer than their own
projections (DeepSeek's decode layers). Only dense 16-bit projections without a bias, of the
mixture's own input and read by nothing else, are taken; others stay as they are.
"""

from torch import fx

from tokenspeed.ir.ops import MOE, OPS as ops
from tokenspeed.passes.manager import graph_pass


@graph_pass("fuse_shared_experts")
def fuse_shared_experts(gm: fx.GraphModule, **_) -> None:
    for moe in [n for n in gm.graph.nodes if n.target == MOE and len(n.args) == 6 and not n.kwargs]:
        down = _plain(moe.args[5], ops.gated_linear.default)
        gate_up = down and _plain(down.args[0], ops.linear.default)
        if gate_up is None or gate_up.args[0] is not moe.args[0]:
            continue
        moe.args = moe.args[:5]
        moe.kwargs = {"shared_w13": gate_up.args[1], "shared_w2": down.args[1]}
        gm.graph.erase_node(down)
        gm.graph.erase_node(gate_up)


def _plain(node, target) -> fx.Node | None:
    """``node`` if it calls ``target`` on a dense weight without a bias, read once (a block
    or FP8 weight names its format in a fourth argument)."""
    fits = isinstance(node, fx.Node) and node.target == target and not node.kwargs and \
        len(node.args) == 3 and node.args[2] is None and len(node.users) == 1
    return node if fits else None
