"""``Traced.lower(mode) -> Lowered``: run the pass pipeline for one mode."""

import attrs
import networkx as nx
import torch

from tokenspeed.backends.descriptors import leaves
from tokenspeed.ir.program import STAGES, Program, Segment
from tokenspeed.passes.breaks import attention_breaks, whole_graph
from tokenspeed.passes.fusion import (fuse_gated_linear, fuse_norm_linear, fuse_norms,
                                      fuse_rope_decode_attention, fuse_rope_write_kv,
                                      select_linear)
from tokenspeed.passes.kernels import decode_kernels
from tokenspeed.passes.manager import HistoryEntry, run_passes
from tokenspeed.passes.narrowing import narrow_rows
from tokenspeed.passes.split import split_segments

MODES = ("prefill", "decode")


def pipeline(mode: str, narrow: bool, decode_graph: bool):
    if mode == "prefill":
        return ([narrow_rows] if narrow else []) + [fuse_norms, attention_breaks, split_segments]
    return [decode_kernels, fuse_norms, fuse_rope_write_kv, fuse_rope_decode_attention,
            select_linear, fuse_gated_linear, fuse_norm_linear,
            whole_graph if decode_graph else attention_breaks, split_segments]


def lower(traced, mode: str = "decode", *, narrow: bool = True, decode_graph: bool = True) -> "Lowered":
    """``narrow`` (prefill): derive the encoder/narrowing/decoder/finish stages.
    ``decode_graph`` (decode): keep attention inside one captured segment; a backend
    without decode-graph support lowers decode with attention breaks instead."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    start = Program(mode=mode, graph_module=traced.graph_module)
    program, history = run_passes(start, pipeline(mode, narrow, decode_graph), config=traced.config)
    return Lowered(mode=mode, program=program, history=history, narrowed=mode == "prefill" and narrow)


@attrs.frozen
class Lowered:
    mode: str
    program: Program = attrs.field(repr=False)
    history: tuple[HistoryEntry, ...] = attrs.field(repr=False)
    narrowed: bool = False

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.program.segments

    @property
    def stages(self) -> dict[str, tuple[Segment, ...]]:
        """Prefill with narrowing: the segments of each stage, in order."""
        if not self.narrowed:
            return {}
        return {s: tuple(seg for seg in self.segments if seg.stage == s) for s in STAGES}

    def as_text(self) -> str:
        return f"# lowered {self.mode}\n" + self.program.as_text()

    def __str__(self) -> str:
        return self.as_text()

    def __call__(self, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        """Run every segment eagerly, in order: the reference for any captured run."""
        env = {"kv_cache": kv_cache, **leaves(meta)}
        for segment in self.segments:
            segment(env)
        return env[self.program.output]

    def to_networkx(self) -> nx.DiGraph:
        g = nx.DiGraph()
        producer = {}
        for seg in self.segments:
            g.add_node(seg.name, kind=seg.kind, stage=seg.stage)
            for value in seg.inputs:
                if value in producer:
                    edge = g.get_edge_data(producer[value], seg.name, {"values": []})
                    g.add_edge(producer[value], seg.name, values=edge["values"] + [value])
            producer.update({v: seg.name for v in seg.outputs})
        return g
