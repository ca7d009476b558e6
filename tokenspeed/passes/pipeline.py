"""The pass pipeline of each mode: a traced graph in, a segmented Program and the
history of every pass out."""

from torch import fx

from tokenspeed.ir.program import Program
from tokenspeed.passes.breaks import attention_breaks, whole_graph
from tokenspeed.passes.fusion import (fuse_gated_linear, fuse_norm_linear, fuse_norms,
                                      fuse_rope_decode_attention, fuse_rope_write_kv,
                                      select_linear)
from tokenspeed.passes.kernels import decode_kernels, extend_kernels
from tokenspeed.passes.manager import HistoryEntry, run_passes
from tokenspeed.passes.narrowing import narrow_rows
from tokenspeed.passes.split import split_segments

MODES = ("prefill", "decode", "verify")


def pipeline(mode: str, narrow: bool, decode_graph: bool) -> list:
    """``verify`` is decode for windows of several rows per request: each row reads keys
    other rows of its request write in the same step, so the cache writes stay a kernel of
    their own, ahead of the attention (the fused kernel writes and attends per row)."""
    if mode == "prefill":
        return ([narrow_rows] if narrow else []) + [extend_kernels, fuse_norms, attention_breaks, split_segments]
    fused = [fuse_rope_decode_attention] if mode == "decode" else []
    return [decode_kernels, fuse_norms, fuse_rope_write_kv, *fused,
            select_linear, fuse_gated_linear, fuse_norm_linear,
            whole_graph if decode_graph else attention_breaks, split_segments]


def run_pipeline(graph_module: fx.GraphModule, config, mode: str, *, narrow: bool = True,
                 decode_graph: bool = True) -> tuple[Program, tuple[HistoryEntry, ...]]:
    """``narrow`` (prefill): derive the encoder/narrowing/decoder/finish stages.
    ``decode_graph`` (decode): keep attention inside one captured segment; a backend
    without decode-graph support lowers decode with attention breaks instead."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    start = Program(mode=mode, graph_module=graph_module)
    return run_passes(start, pipeline(mode, narrow, decode_graph), config=config)
