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
        if _gathers_sampled_rows(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)


def _gathers_sampled_rows(node: fx.Node) -> bool:
    """``x.index_select(0, sample_rows)``: rows only (another dimension is not the identity)."""
    return (node.op == "call_method" and node.target == "index_select" and len(node.args) == 3
            and node.args[1] == 0 and getattr(node.args[2], "name", None) == "sample_rows")
