"""The pass pipeline of each mode: a traced graph in, a segmented Program and the
history of every pass out."""

from torch import fx

from tokenspeed.ir.program import Program
from tokenspeed.passes.breaks import attention_breaks, stage_breaks, whole_graph
from tokenspeed.passes.fusion import (fuse_gated_linear, fuse_head_norms, fuse_latent_write, fuse_moe_add,
                                      fuse_norm_linear, fuse_norm_route, fuse_norms, fuse_rope_decode_attention,
                                      fuse_rope_write_kv, rope_kernels, select_linear)
from tokenspeed.passes.kernels import decode_kernels, extend_kernels, recurrent_steps
from tokenspeed.passes.latent_decode import fuse_latent_query_rope, fuse_latent_write_attention
from tokenspeed.passes.manager import HistoryEntry, run_passes
from tokenspeed.passes.narrowing import narrow_rows
from tokenspeed.passes.router import fuse_router
from tokenspeed.passes.sampled_rows import drop_sample_gather
from tokenspeed.passes.shared_experts import fuse_shared_experts
from tokenspeed.passes.split_merge import merge_splits_in_launch
from tokenspeed.passes.split import split_segments

MODES = ("prefill", "decode", "verify")


def pipeline(mode: str, narrow: bool, decode_graph: bool, prefill_breaks: bool = True) -> list:
    """``verify`` is decode for windows of several rows per request: each row reads keys
    other rows of its request write in the same step, so the cache writes stay a kernel of
    their own, ahead of the attention (the fused kernel writes and attends per row)."""
    if mode == "prefill":
        breaks = attention_breaks if prefill_breaks else stage_breaks
        return ([narrow_rows] if narrow else []) + [extend_kernels, fuse_norms, fuse_rope_write_kv,
                                                     rope_kernels, fuse_latent_write, fuse_moe_add, breaks,
                                                     split_segments]
    decode = mode == "decode"
    steps, fused = ([recurrent_steps], [fuse_rope_decode_attention, fuse_head_norms]) if decode else ([], [])
    latent = [fuse_latent_write_attention] if decode else []
    return [decode_kernels, drop_sample_gather, *steps, fuse_norms, fuse_rope_write_kv, *fused, rope_kernels,
            fuse_latent_write, fuse_latent_query_rope, *latent, fuse_moe_add, select_linear, fuse_gated_linear,
            fuse_shared_experts, fuse_router, fuse_norm_route, fuse_norm_linear, merge_splits_in_launch,
            whole_graph if decode_graph else attention_breaks, split_segments]


def run_pipeline(graph_module: fx.GraphModule, config, mode: str, *, narrow: bool = True,
                 decode_graph: bool = True, attention_breaks: bool | None = None
                 ) -> tuple[Program, tuple[HistoryEntry, ...]]:
    """``narrow`` (prefill): derive the encoder/narrowing/decoder/finish stages.
    ``decode_graph`` (decode): keep attention inside one captured segment; a backend
    without decode-graph support lowers decode with attention breaks instead.
    ``attention_breaks`` (prefill): run each attention eagerly in a break of its own;
    else it stays in its stage's graph (the backend's ``prefill_attention`` support).
    None: breaks only without the narrowing."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    attention_breaks = not narrow if attention_breaks is None else attention_breaks
    if mode == "prefill" and not (attention_breaks or narrow):
        raise ValueError("prefill attention inside the graphs needs the narrowing: the stages "
                         "keep the sampled rows' gather out of the captured graphs")
    start = Program(mode=mode, graph_module=graph_module)
    return run_passes(start, pipeline(mode, narrow, decode_graph, attention_breaks), config=config)
