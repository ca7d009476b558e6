"""``fuse_latent_write_attention``: which writes join which attentions. Built on hand-made
graphs: a latent layer's cache write, then its attention, and the cases the pass must leave
alone (another table's positions, an attention before the write, a reader in between)."""

import pytest
import torch
from torch import fx

import tokenspeed.backends  # noqa: F401  (declares and registers the ops)
from tokenspeed.ir.ops import MLA_DECODE_ATTENTION, MLA_WRITE_DECODE_ATTENTION, NORM_ROPE_WRITE_LATENT
from tokenspeed.ir.program import Program
from tokenspeed.passes.latent_decode import fuse_latent_write_attention

INPUTS = ("q_nope", "q_rope", "latent", "k_rope", "cos_sin", "positions", "other_positions", "kv_cache",
          "slot_mapping", "block_tables", "row_request", "kv_b", "norm")


def layer(order: str, attention_positions: str = "positions") -> fx.GraphModule:
    """``order``: the nodes as they run, ``w`` the write, ``a`` the attention, ``r`` another
    reader of the cache (an attention of the same layer without the rotation)."""
    graph = fx.Graph()
    x = {name: graph.placeholder(name) for name in INPUTS}
    reads = (x["kv_cache"], 0, x["block_tables"], x["row_request"])
    outputs = []
    for step in order:
        if step == "w":
            graph.call_function(NORM_ROPE_WRITE_LATENT, (x["latent"], x["norm"], 1e-6, x["k_rope"], x["cos_sin"],
                                                         x["positions"], True, x["kv_cache"], 0, x["slot_mapping"]))
        else:
            kwargs = {"cos_sin": x["cos_sin"], "rope_interleaved": True} if step == "a" else {}
            outputs.append(graph.call_function(MLA_DECODE_ATTENTION, (
                x["q_nope"], x["q_rope"], *reads, x[attention_positions], x["kv_b"], 0.1), kwargs))
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def targets(order: str, **kw) -> list:
    fused = fuse_latent_write_attention(Program(mode="decode", graph_module=layer(order, **kw))).graph_module
    return [n.target for n in fused.graph.nodes if n.op == "call_function"]


def test_a_write_joins_the_attention_after_it():
    assert targets("wa") == [MLA_WRITE_DECODE_ATTENTION]


@pytest.mark.parametrize("order, positions", [
    ("wa", "other_positions"),   # the attention rotates at other positions than the write
    ("aw", "positions"),         # the attention runs before the write: it must not read this step's rows
    ("wra", "positions"),        # another reader of the cache sits between them
])
def test_the_pass_leaves_a_write_it_cannot_move_alone(order, positions):
    assert targets(order, attention_positions=positions).count(MLA_WRITE_DECODE_ATTENTION) == 0
    assert targets(order, attention_positions=positions).count(NORM_ROPE_WRITE_LATENT) == 1
