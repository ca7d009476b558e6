"""The CUDA kernel of every IR op: Triton, or cuBLAS where it wins.

The kernel is chosen from shapes and the weight's format alone (projections: a GEMV up
to ``GEMV_MAX_ROWS`` rows; a GGUF block format's weight by the GGUF kernels; an FP8
weight by the FP8 GEMV, or FP8 tensor cores past ``GEMV_MAX_ROWS``), never from
tensor values, so eager runs and captured graphs of the same shapes take the
same kernels. Triton modules are imported on first use, so a CPU process never loads
Triton. Where a fused form is slower for a shape (see docs/PERFORMANCE.md), the op runs
as the CUDA kernels of its parts.
"""

import torch

from tokenspeed.backends.kernels import group_route_reference
from tokenspeed.backends.kernels.fla_state import (  # noqa: F401  (fla's)
    causal_conv_silu, gated_delta_rule, gated_delta_rule_step)
from tokenspeed.backends.kernels.gguf_blocks import block_format
from tokenspeed.backends.kernels.state_reference import causal_conv_silu_step  # noqa: F401  (torch, captured)
from tokenspeed.backends.kernels.mla_reference import write_latent  # noqa: F401  (an index_copy_)
from tokenspeed.backends.kernels.reference import choose, flat_slots, gate_logits
from tokenspeed.backends.metadata import EXTEND_TILE_ROWS
from tokenspeed.ir.weights import DENSE, FP8, INT4, INT8

GEMV_MAX_ROWS = 16  # up to here a linear layer streams its weight: the split-K GEMV wins
GGUF_DEQUANTIZED_ROWS = 128  # from here a GGUF weight is decoded whole for cuBLAS (prefill)
GGUF_NORM_GEMV_MAX_N = 4096  # past this many outputs (1B: gate_up, head) a GGUF GEMV reads a normed input
FP8_NORM_GEMV_MAX_WEIGHTS = 2048 * 2048   # past this many (1B: qkv, gate_up) an FP8 GEMV reads a normed input


def write_kv(k, v, kv_cache, layer, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
    from tokenspeed.backends.kernels import triton_cache
    triton_cache.write_kv(k, v, flat_slots(kv_cache)[0], layer, slot_mapping, k_scale, v_scale)


def attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window, k_scale=1.0,
              v_scale=1.0):
    from tokenspeed.backends.kernels import triton_attention
    flat, page_size = flat_slots(kv_cache)
    return triton_attention.extend_attention(q, flat, layer, block_tables, row_request,
                                             positions, scale, page_size, window=window,
                                             k_scale=k_scale, v_scale=v_scale)


def extend_attention(q, kv_cache, layer, block_tables, row_request, positions, tiles, scale, window,
                     k_scale=1.0, v_scale=1.0):
    from tokenspeed.backends.kernels import triton_attention
    flat, page_size = flat_slots(kv_cache)
    return triton_attention.extend_attention(q, flat, layer, block_tables, row_request, positions, scale,
                                             page_size, plan=triton_attention.ExtendPlan(tiles, EXTEND_TILE_ROWS),
                                             window=window, k_scale=k_scale, v_scale=v_scale)


def decode_attention(q, kv_cache, layer, block_tables, row_request, positions, scale, window, k_scale=1.0,
                     v_scale=1.0):
    from tokenspeed.backends.kernels import triton_decode
    flat, page_size = flat_slots(kv_cache)
    return triton_decode.decode_attention(q, flat, layer, block_tables, row_request,
                                          positions, scale, page_size, window=window,
                                          k_scale=k_scale, v_scale=v_scale)


def norm_rope_write_latent(latent, norm_weight, eps, k_rope, cos_sin, positions, interleaved, kv_cache, layer,
                           slot_mapping) -> None:
    from tokenspeed.backends.kernels import triton_latent
    triton_latent.norm_rope_write_latent(latent, norm_weight, eps, k_rope, cos_sin, positions, interleaved, kv_cache,
                                         layer, slot_mapping)


def mla_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions, kv_b_weight, scale):
    from tokenspeed.backends.kernels import triton_mla
    return triton_mla.mla_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions,
                                    kv_b_weight, scale)


def mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions, kv_b_weight,
                         scale, cos_sin=None, rope_interleaved=False):
    from tokenspeed.backends.kernels import triton_mla
    rope = None if cos_sin is None else triton_mla.QueryRope(cos_sin, rope_interleaved)
    return triton_mla.mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions,
                                           kv_b_weight, scale, rope=rope)


def mla_write_decode_attention(q_nope, q_rope, latent, norm_weight, eps, k_rope, cos_sin, positions,
                               rope_interleaved, kv_cache, layer, slot_mapping, block_tables, row_request,
                               kv_b_weight, scale):
    from tokenspeed.backends.kernels import triton_latent, triton_mla
    write = triton_latent.LatentWrite.of(latent, norm_weight, eps, k_rope, cos_sin, positions, rope_interleaved,
                                         kv_cache, layer, slot_mapping)
    return triton_mla.mla_decode_attention(q_nope, q_rope, kv_cache, layer, block_tables, row_request, positions,
                                           kv_b_weight, scale, rope=triton_mla.QueryRope(cos_sin, rope_interleaved),
                                           write=write)


def rope_decode_attention(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping,
                          block_tables, row_request, scale, window, k_scale=1.0, v_scale=1.0, q_norm=None,
                          k_norm=None, norm_eps=0.0):
    from tokenspeed.backends.kernels import triton_decode
    flat, page_size = flat_slots(kv_cache)
    return triton_decode.rope_decode_attention(q, k, v, cos_sin, positions, flat, layer,
                                               slot_mapping, block_tables, row_request,
                                               scale, page_size, window=window,
                                               k_scale=k_scale, v_scale=v_scale,
                                               head_norms=triton_decode.HeadNorms(q_norm, k_norm, norm_eps))


def silu_and_mul(gate_up):
    from tokenspeed.backends.kernels import triton_fused
    return triton_fused.silu_and_mul(gate_up)


def rms_norm(x, weight, eps):
    from tokenspeed.backends.kernels import triton_fused
    return triton_fused.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def add_rms_norm(x, residual, weight, eps):
    from tokenspeed.backends.kernels import triton_fused
    return list(triton_fused.add_rms_norm(x, residual, weight, eps))


def rope(x, cos_sin, positions, interleaved):
    from tokenspeed.backends.kernels import triton_rope
    return triton_rope.rope(x, cos_sin, positions, interleaved)


def rope_write_kv(q, k, v, cos_sin, positions, kv_cache, layer, slot_mapping, k_scale=1.0, v_scale=1.0):
    from tokenspeed.backends.kernels import triton_fused
    return triton_fused.rope_and_write_kv(q, k, v, cos_sin, positions, flat_slots(kv_cache)[0],
                                          layer, slot_mapping, k_scale, v_scale)


def linear(x, weight, bias, weight_format=DENSE, weight_scale=None, split_counters=None):
    """``split_counters``: the dense GEMV reduces a split K in its own launch."""
    _refuse_cpu_formats(weight_format)
    if weight_format == FP8:
        return _fp8_linear(x, weight, bias, weight_scale)
    if weight_format != DENSE:
        return _block_linear(x, weight, bias, weight_format)
    if x.shape[0] <= GEMV_MAX_ROWS:
        from tokenspeed.backends.kernels import triton_gemv
        return triton_gemv.linear(x, weight, bias, split_counters=split_counters)
    return torch.nn.functional.linear(x, weight, bias)


def _refuse_cpu_formats(weight_format) -> None:
    if weight_format in (INT4, INT8):
        raise ValueError(f"{weight_format} weights (quantization='int4') run on the CPU only; on a GPU "
                         "use 'fp8' or a GGUF file's blocks")


def _block_linear(x, weight, bias, weight_format):
    """A block format's weight read by the GGUF kernels: the GEMV for one row, the
    dequantizing tensor-core matmul for more; from ``GGUF_DEQUANTIZED_ROWS`` rows (prefill)
    the weight is decoded whole into x's dtype and multiplied by cuBLAS, whose matmul
    outruns decoding each tile (its 2.5 bytes an element more are ~20 us for the 1B
    shape's largest projection, against a matmul of ~180 us)."""
    from tokenspeed.backends.kernels import triton_gguf_embedding, triton_gguf_matmul
    rows, fmt = x.reshape(-1, x.shape[-1]), block_format(weight_format)
    if rows.shape[0] >= GGUF_DEQUANTIZED_ROWS:
        every_row = torch.arange(weight.shape[0], device=weight.device)
        out = torch.nn.functional.linear(rows, triton_gguf_embedding.embedding(every_row, weight, fmt, x.dtype), bias)
    else:
        out = triton_gguf_matmul.linear(rows, weight, fmt, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _fp8_linear(x, weight, bias, scale, gated=False):
    """The FP8 GEMV for decode's rows (``gated``: it reads ``silu_and_mul`` of its input),
    activations quantized per row onto FP8 tensor cores for more."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] <= GEMV_MAX_ROWS:
        from tokenspeed.backends.kernels import triton_fp8_gemv
        out = triton_fp8_gemv.linear(rows, weight, scale, bias, gated=gated)
    else:
        from tokenspeed.backends.kernels import fp8_matmul
        out = fp8_matmul.linear(silu_and_mul(rows) if gated else rows, weight, scale, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def gated_linear(gate_up, weight, bias, weight_format=DENSE, weight_scale=None, split_counters=None):
    """Fused for one row of a 16-bit or FP8 weight only: with more rows, the activation
    between the loads and ``tl.dot`` stalls the GEMV's pipeline; a GGUF GEMV program spends
    more on the activation of its whole input than on its rows' blocks (Q4_K, 1B shape's
    down projection on the H200: 17 us fused, 12 us with ``silu_and_mul`` before it)."""
    _refuse_cpu_formats(weight_format)
    if gate_up.shape[0] == 1 and weight_format in (DENSE, FP8):
        return _gated_gemv(gate_up, weight, bias, weight_format, weight_scale, split_counters)
    return linear(silu_and_mul(gate_up), weight, bias, weight_format, weight_scale, split_counters)


def _gated_gemv(gate_up, weight, bias, weight_format, weight_scale, split_counters):
    if weight_format == FP8:
        return _fp8_linear(gate_up, weight, bias, weight_scale, gated=True)
    from tokenspeed.backends.kernels import triton_gemv
    return triton_gemv.linear(gate_up, weight, bias, gated=True, split_counters=split_counters)


def norm_linear(x, residual, norm_weight, eps, weight, bias, weight_format=DENSE, weight_scale=None,
                split_counters=None):
    """Fused for one row only: with more, every GEMV program re-reads all rows for the
    statistics in a loop that is not pipelined. A GGUF weight's norm runs before its GEMV
    past ``GGUF_NORM_GEMV_MAX_N`` outputs, an FP8 weight's past ``FP8_NORM_GEMV_MAX_WEIGHTS``
    weights: each GEMV program norms the whole input, which costs more than the saved
    kernel once programs are many (on the H200, Q4_K, 1B shape: the head 172 us fused, about
    90 apart; FP8, one row, graphs of 20 calls: 5120 x 4096 9.9 us fused, 8.3 apart; 2048 x
    2048 and smaller faster fused). Past ``GEMV_MAX_ROWS``, a per-channel FP8 weight's rows
    are normed and quantized for its tensor cores in one kernel."""
    _refuse_cpu_formats(weight_format)
    rows = x.shape[0] if x.dim() == 2 else None
    if rows == 1 and _fuses_norm(weight, weight_format):
        out, total = _norm_gemv(x, residual, norm_weight, eps, weight, bias, weight_format, weight_scale,
                                split_counters)
    elif rows is not None and rows > GEMV_MAX_ROWS and weight_format == FP8 and weight_scale.dim() == 1:
        from tokenspeed.backends.kernels import fp8_matmul
        out, total = fp8_matmul.norm_linear(x, residual, norm_weight, eps, weight, weight_scale, bias)
    elif residual is None:
        out, total = linear(rms_norm(x, norm_weight, eps), weight, bias, weight_format, weight_scale,
                            split_counters), None
    else:
        normed, total = add_rms_norm(x, residual, norm_weight, eps)
        out = linear(normed, weight, bias, weight_format, weight_scale, split_counters)
    return [out] if total is None else [out, total]


def _fuses_norm(weight, weight_format) -> bool:
    if weight_format == FP8:
        return weight.numel() <= FP8_NORM_GEMV_MAX_WEIGHTS
    return weight_format == DENSE or weight.shape[0] <= GGUF_NORM_GEMV_MAX_N


def _norm_gemv(x, residual, norm_weight, eps, weight, bias, weight_format, weight_scale, split_counters):
    if weight_format == DENSE:
        from tokenspeed.backends.kernels import triton_gemv
        return triton_gemv.norm_linear(x, residual, norm_weight, eps, weight, bias, split_counters=split_counters)
    if weight_format == FP8:
        from tokenspeed.backends.kernels import triton_fp8_gemv
        return triton_fp8_gemv.norm_linear(x, residual, norm_weight, eps, weight, weight_scale, bias)
    from tokenspeed.backends.kernels import triton_gguf_gemv
    return triton_gguf_gemv.norm_gemv(x, residual, norm_weight, eps, weight,
                                      block_format(weight_format), bias)


def embedding(ids, weight, weight_format, features, dtype):
    """A block table's rows decoded as they are gathered (``triton_gguf_embedding``)."""
    if weight_format == DENSE:
        return weight[ids].to(dtype)
    from tokenspeed.backends.kernels import triton_gguf_embedding
    return triton_gguf_embedding.embedding(ids, weight, block_format(weight_format), dtype)


def softmax_top_k(logits, k, normalize, scale):
    from tokenspeed.backends.kernels import triton_route
    return triton_route.softmax_top_k(logits, k, normalize, scale)


def group_top_k(logits, correction_bias, k, n_group, topk_group, method, normalize, scale):
    """One launch a step (``triton_group_route``); a router past one program's experts or
    groups runs the ops it stands for."""
    from tokenspeed.backends.kernels import triton_group_route
    if not triton_group_route.fits(logits.shape[-1], n_group):
        return group_route_reference.group_top_k(logits, correction_bias, k, n_group, topk_group, method, normalize,
                                                 scale)
    return triton_group_route.group_top_k(logits, correction_bias, k, n_group, topk_group, method, normalize, scale)


def route(x, weight, k, normalize, scale, logits_dtype=None, split_counters=None, correction_bias=None, n_group=1,
          topk_group=1, method="greedy"):
    """One launch for a decode step's rows (``triton_route.route``); more rows, no counters
    or a grouped choice past one program's, run the ops it stands for: the gate's product,
    then the choice."""
    from tokenspeed.backends.kernels import triton_route
    grouping = _grouping(correction_bias, n_group, topk_group, method)
    if split_counters is not None and x.shape[0] <= triton_route.ROUTE_MAX_ROWS and _one_program(weight, grouping):
        return triton_route.route(x, weight, k, normalize, scale, logits_dtype, split_counters, grouping)
    return choose(gate_logits(x, weight, logits_dtype, linear), k, normalize, scale, correction_bias, n_group,
                  topk_group, method, softmax_top_k, group_top_k)


def norm_route(x, residual, norm_weight, eps, weight, k, normalize, scale, logits_dtype=None, split_counters=None,
               correction_bias=None, n_group=1, topk_group=1, method="greedy"):
    """One launch for one row of up to ``triton_route.NORM_TILE`` features (``triton_route.
    norm_route``), as ``norm_linear`` fuses its norm for one row only; more rows, or a wider
    row (whose statistics take several tiles: DeepSeek-V3's 7,168, 10.39 us fused against
    10.01 apart on the H200), run the norm's kernel, then ``route``."""
    from tokenspeed.backends.kernels import triton_route
    grouping = _grouping(correction_bias, n_group, topk_group, method)
    if split_counters is not None and x.dim() == 2 and x.shape[0] == 1 and x.shape[1] <= triton_route.NORM_TILE \
            and _one_program(weight, grouping):
        return triton_route.norm_route(x, residual, norm_weight, eps, weight, k, normalize, scale, logits_dtype,
                                       split_counters, grouping)
    norm = [rms_norm(x, norm_weight, eps)] if residual is None else add_rms_norm(x, residual, norm_weight, eps)
    return [*route(norm[0], weight, k, normalize, scale, logits_dtype, split_counters, correction_bias, n_group,
                   topk_group, method), *norm]


def _grouping(correction_bias, n_group: int, topk_group: int, method: str):
    """A route's grouped choice as ``triton_route`` takes it; None for the greedy one."""
    from tokenspeed.backends.kernels import triton_group_route
    return None if method == "greedy" else triton_group_route.Grouping(correction_bias, n_group, topk_group, method)


def _one_program(weight, grouping) -> bool:
    """Whether the last program of a route's launch holds its grouped choice."""
    from tokenspeed.backends.kernels import triton_group_route
    return grouping is None or triton_group_route.fits(weight.shape[0], grouping.n_group)


def moe(x, w13, w2, topk_weights, topk_ids, shared=None, shared_w13=None, shared_w2=None):
    """The shared experts' weights: their MLP inside the pair launches for a step of a few
    tokens; past that, their projections run first, as their own ops would."""
    from tokenspeed.backends.kernels import triton_moe, triton_moe_pairs
    experts = None if shared_w13 is None else triton_moe_pairs.SharedExperts(shared_w13, shared_w2)
    if experts is not None and topk_ids.shape[0] > triton_moe_pairs.MAX_TOKENS:
        shared, experts = gated_linear(linear(x, shared_w13, None), shared_w2, None), None
    return triton_moe.moe(x, w13, w2, topk_weights, topk_ids, shared, experts)
