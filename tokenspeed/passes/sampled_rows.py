"""A decode step samples every row: ``refresh_decode`` publishes ``sample_rows`` as
``0 .. rows - 1`` (padding rows too; their tokens are dropped on the host), and a verify
window's rows are each sampled. So decode's gather of the sampled rows copies its input,
and a launch (plus the norm's own, at one row) is spent on it: with the gather gone, the
final norm's only reader is the head, and ``fuse_norm_linear`` joins them."""

from torch import fx

from tokenspeed.passes.manager import graph_pass


@graph_pass("drop_sample_gather")
def drop_sample_gather(gm: fx.GraphModule, **_) -> None:
    for node in list(gm.graph.nodes):
        if node.target == "index_select" and getattr(node.args[2], "name", None) == "sample_rows":
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
