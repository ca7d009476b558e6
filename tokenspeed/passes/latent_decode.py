"""A latent (MLA) decode layer's fusions, one launch a layer fewer each (DeepSeek's layers).

- ``fuse_latent_query_rope``: the attention rotates its query's rope part as it loads it,
  where a ``rope`` op read by that attention alone did it before. The rotation is the
  ``rope`` op's (its table, positions and pairing), so the attention op takes the table and
  the pairing (``cos_sin``, ``rope_interleaved``); it must be the step's own positions,
  which the attention reads too.
- ``fuse_latent_write_attention``: the layer's cache write (``norm_rope_write_latent``)
  joins that attention when both rotate by one table, pairing and positions, the write
  comes first and nothing between them touches the cache
  (``tokenspeed::mla_write_decode_attention``): the launch that absorbs the query writes
  the rows' latents, and the attention's launch after it reads them.
"""

from torch import fx

from tokenspeed.ir.ops import MLA_DECODE_ATTENTION, MLA_WRITE_DECODE_ATTENTION, NORM_ROPE_WRITE_LATENT, ROPE
from tokenspeed.passes.fusion import _substitute
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


@graph_pass("fuse_latent_write_attention")
def fuse_latent_write_attention(gm: fx.GraphModule, **_) -> None:
    writes = {(w.args[7], w.args[8]): w for w in gm.graph.nodes if w.target == NORM_ROPE_WRITE_LATENT}
    for node in [n for n in gm.graph.nodes if n.target == MLA_DECODE_ATTENTION and "cos_sin" in n.kwargs]:
        q_nope, q_rope, cache, layer, block_tables, row_request, positions, kv_b_weight, scale = node.args
        write = writes.get((cache, layer))
        if write is None or not _joinable(write, node):
            continue
        latent, weight, eps, k_rope, table, write_positions, interleaved, _, _, slots = write.args
        if (table, write_positions, interleaved) != (node.kwargs["cos_sin"], positions,
                                                      node.kwargs["rope_interleaved"]):
            continue
        _substitute(gm, node, MLA_WRITE_DECODE_ATTENTION, (
            q_nope, q_rope, latent, weight, eps, k_rope, table, positions, interleaved, cache, layer, slots,
            block_tables, row_request, kv_b_weight, scale))
        del writes[cache, layer]
        gm.graph.erase_node(write)


def _joinable(write: fx.Node, attention: fx.Node) -> bool:
    """The write comes before the attention and nothing between them touches the cache: the
    write moves to the attention's place."""
    cache, node = write.args[7], write.next
    while node is not attention:
        if node.op == "output" or cache in node.all_input_nodes:
            return False
        node = node.next
    return True
