"""``fuse_latent_query_rope``: a latent (MLA) decode attention rotates its query's rope
part as it loads it, where a ``rope`` op read by that attention alone did it before: one
launch a layer fewer (DeepSeek's decode layers).

The rotation is the ``rope`` op's (its table, positions and pairing), so the attention op
takes the table and the pairing (``cos_sin``, ``rope_interleaved``); it must be the step's
own positions, which the attention reads too.
"""

from torch import fx

from tokenspeed.ir.ops import MLA_DECODE_ATTENTION, ROPE
from tokenspeed.passes.manager import graph_pass


@graph_pass("fuse_latent_query_rope")
def fuse_latent_query_rope(gm: fx.GraphModule, **_) -> None:
    for node in [n for n in gm.graph.nodes if n.target == MLA_DECODE_ATTENTION and not n.kwargs]:
        rope = node.args[1]
        if not (isinstance(rope, fx.Node) and rope.target == ROPE and len(rope.users) == 1):
            continue
        x, table, positions, interleaved = rope.args
        if positions is not node.args[6]:
            continue
        node.args = (node.args[0], x, *node.args[2:])
        node.kwargs = {"cos_sin": table, "rope_interleaved": interleaved}
        gm.graph.erase_node(rope)
