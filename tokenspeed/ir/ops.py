"""The IR's custom ops: schemas and shape functions, no kernels.

Models call ``write_kv`` and ``attention``; the decode passes substitute the fused ops for
runs of plain ops. Each op is a leaf of the FX graph, its fake implementation lets shape
propagation run on fake tensors, and its kernels come from the backends, which register
one per device type (``register_kernel``): the IR names what is computed, a backend says
how. ``write_kv`` and ``attention`` are separate so the row-narrowing pass can see the
last cache write: keys and values are needed on every token row, queries only on the rows
that are kept.

The cache is ``kv_cache[layer, 0 | 1, page, offset, kv_head, head_dim]``: the page size
is part of its shape, so no op takes it as an argument. The ops that write or read it
take the layer's ``k_scale`` and ``v_scale``: a float8 cache stores ``k / k_scale`` and
reads back ``stored * k_scale`` (``backends.kernels.kv_fp8``); another dtype ignores
them. Models pass them as keywords, so the IR names them. A ``cos_sin`` table is
``cat(cos, sin)`` of every position's rotary angles (``tokenspeed.ir.rope``).

A latent-attention (MLA) model's cache has one part and one head,
``kv_cache[layer, 0, page, offset, 0, :]`` = a token's latent then its rotated rope key:
``write_latent`` stores it and ``mla_attention`` reads it (``mla_decode_attention``, its
decode form), up-projecting through the layer's ``kv_b_weight`` ``[heads * (nope + v),
latent]`` (per head: the key's nope rows, then the value's).
"""

import inspect

import torch

from tokenspeed.ir.weights import DENSE


def _op(name: str, mutates_args=()):
    """Declare ``tokenspeed::name`` with the decorated function's signature as its schema
    and its body as the shape function; its kernels come from the backends."""
    def declare(fake):
        optional = [n for n in mutates_args
                    if inspect.signature(fake).parameters[n].default is not inspect.Parameter.empty]
        if optional:   # see linear's split_counters
            raise TypeError(f"tokenspeed::{name} declares optional arguments mutated: {optional}")
        schema = torch.library.infer_schema(fake, mutates_args=mutates_args)
        op = torch.library.custom_op(f"tokenspeed::{name}", _unregistered(name),
                                     mutates_args=mutates_args, schema=schema)
        op.register_fake(fake)
        return op
    return declare


def _unregistered(name: str):
    """The kernel of a device no backend registered one for: an error, never a fallback."""
    def run(*args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        raise NotImplementedError(f"tokenspeed::{name} has no {device.type} kernel: backends "
                                  "register theirs when tokenspeed.backends is imported")
    return run


@_op("write_kv", mutates_args=("kv_cache",))
def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store a layer's keys and values ``[rows, kv_heads, head_dim]`` at their slots."""
    return None


@_op("attention")
def attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
              row_request: torch.Tensor, positions: torch.Tensor, scale: float,
              window: int, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Row r attends causally to positions ``0..positions[r]`` of request
    ``row_request[r]``, found through ``block_tables``; with a sliding ``window`` (0: the
    whole context) only to the last ``window`` of them, ``positions[r] - window + 1`` on."""
    return torch.empty_like(q)


@_op("extend_attention")
def extend_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                     row_request: torch.Tensor, positions: torch.Tensor, tiles: torch.Tensor, scale: float,
                     window: int, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """``attention`` over rows grouped by request into the step's tiles: tile t is the rows
    ``tiles[t] .. tiles[t + 1] - 1``, all of one request; ``tiles`` ends with the number of
    rows it covers, and a row outside every tile (padding) has no defined output. What
    prefill lowering selects: the plan is built once per step with the metadata, not by
    every layer's attention."""
    return torch.empty_like(q)


@_op("decode_attention")
def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int, block_tables: torch.Tensor,
                     row_request: torch.Tensor, positions: torch.Tensor, scale: float,
                     window: int, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """``attention`` restricted to one row per request: what decode lowering selects."""
    return torch.empty_like(q)


@_op("write_latent", mutates_args=("kv_cache",))
def write_latent(latent: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                 slot_mapping: torch.Tensor) -> None:
    """Store a layer's normed latents ``[rows, latent]`` and rotated rope keys ``[rows, rope]``."""
    return None


@_op("norm_rope_write_latent", mutates_args=("kv_cache",))
def norm_rope_write_latent(latent: torch.Tensor, norm_weight: torch.Tensor, eps: float, k_rope: torch.Tensor,
                           cos_sin: torch.Tensor, positions: torch.Tensor, interleaved: bool, kv_cache: torch.Tensor,
                           layer: int, slot_mapping: torch.Tensor) -> None:
    """``write_latent(rms_norm(latent), rope(k_rope [T, 1, D]))``: a latent layer's cache
    write, its norm and its key's rotary in one kernel."""


@_op("mla_attention")
def mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  block_tables: torch.Tensor, row_request: torch.Tensor, positions: torch.Tensor,
                  kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
    """Latent attention of rows ``q_nope [rows, H, nope]``, ``q_rope [rows, H, rope]`` (as
    ``attention``: row r causally over request ``row_request[r]``'s positions up to
    ``positions[r]``); ``[rows, H, v]``. Keys and values expanded from the latents."""
    heads, v_dim = q_nope.shape[1], kv_b_weight.shape[0] // q_nope.shape[1] - q_nope.shape[2]
    return q_nope.new_empty(q_nope.shape[0], heads, v_dim)


@_op("mla_decode_attention")
def mla_decode_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         block_tables: torch.Tensor, row_request: torch.Tensor, positions: torch.Tensor,
                         kv_b_weight: torch.Tensor, scale: float, cos_sin: torch.Tensor | None = None,
                         rope_interleaved: bool = False) -> torch.Tensor:
    """``mla_attention`` of one row per request in the absorbed form: the key's
    up-projection folded into the query, the value's applied after attending the latents.
    With ``cos_sin``, ``q_rope`` comes unrotated: ``rope(q_rope, cos_sin, positions,
    rope_interleaved)`` is what it attends with."""
    heads, v_dim = q_nope.shape[1], kv_b_weight.shape[0] // q_nope.shape[1] - q_nope.shape[2]
    return q_nope.new_empty(q_nope.shape[0], heads, v_dim)


@_op("mla_write_decode_attention", mutates_args=("kv_cache",))
def mla_write_decode_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor,
                               norm_weight: torch.Tensor, eps: float, k_rope: torch.Tensor, cos_sin: torch.Tensor,
                               positions: torch.Tensor, rope_interleaved: bool, kv_cache: torch.Tensor, layer: int,
                               slot_mapping: torch.Tensor, block_tables: torch.Tensor, row_request: torch.Tensor,
                               kv_b_weight: torch.Tensor, scale: float) -> torch.Tensor:
    """``norm_rope_write_latent(latent, norm_weight, eps, k_rope, cos_sin, positions,
    rope_interleaved, kv_cache, layer, slot_mapping)``, then ``mla_decode_attention`` of the
    unrotated ``q_rope`` by the same table: a latent decode layer's cache write joins its
    attention (the query's absorption launch writes the rows)."""
    heads, v_dim = q_nope.shape[1], kv_b_weight.shape[0] // q_nope.shape[1] - q_nope.shape[2]
    return q_nope.new_empty(q_nope.shape[0], heads, v_dim)


@_op("silu_and_mul")
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a stacked ``[rows, 2 * I]`` projection (gate first)."""
    return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


@_op("rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As Hugging Face Llama: float32 statistics, the weight applied in the input dtype."""
    return torch.empty_like(x)


@_op("add_rms_norm")
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> list[torch.Tensor]:
    """``[rms_norm(x + residual), x + residual]``: the residual add fused into the norm."""
    return [torch.empty_like(x), torch.empty_like(x)]


@_op("rope")
def rope(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """``x[rows, heads, dim]`` rotated at ``positions[rows]`` by the table's rows (a new
    tensor). ``interleaved``: adjacent elements pair up, and come out as halves (evens, then
    odds), as DeepSeek's rotary gathers them (``models.mla_rotary``)."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_op("rope_write_kv", mutates_args=("kv_cache",))
def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                  positions: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Rotate q and k, write k and v to the cache; returns the rotated q."""
    return torch.empty_like(q)


@_op("rope_decode_attention", mutates_args=("kv_cache",))
def rope_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cos_sin: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                          layer: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                          row_request: torch.Tensor, scale: float, window: int, k_scale: float = 1.0,
                          v_scale: float = 1.0, q_norm: torch.Tensor | None = None,
                          k_norm: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    """``decode_attention(rope_write_kv(...))``: one kernel rotates, writes the row's key and
    value and attends, using that key from registers. ``q_norm``, ``k_norm``: weights of a
    per-head RMSNorm (Qwen3's) of q and k before the rotation, ``rms_norm``'s (eps ``norm_eps``)."""
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@_op("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           weight_format: str = DENSE, weight_scale: torch.Tensor | None = None,
           split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """A linear layer whose kernel the backend chooses by shape (a GEMV for few rows) and by
    ``weight_format`` (``tokenspeed.ir.weights``): a block format's weight is its
    ``uint8 [N, row_bytes]`` blocks, so N is ``weight.shape[0]`` either way; an FP8
    weight comes with its ``weight_scale``. ``split_counters``: a zeroed int32 workspace kept
    between steps, with which a kernel that splits K (the GEMV) reduces the splits in the
    same launch. It leaves them zeroed, as it found them, so no op declares them mutated (nor
    may any declare an optional argument so: torch 2.11 bumps the version of every mutated
    argument by its position in the call, and an omitted one raised an IndexError)."""
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@_op("gated_linear")
def gated_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_format: str = DENSE, weight_scale: torch.Tensor | None = None,
                 split_counters: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(silu_and_mul(gate_up))``: the MLP activation read inside the down projection."""
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])


@_op("norm_linear")
def norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_format: str = DENSE, weight_scale: torch.Tensor | None = None,
                split_counters: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``[linear(rms_norm(x + residual)), x + residual]`` (``[linear(rms_norm(x))]`` without
    a residual): a norm read inside the projection it feeds."""
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return [out] if residual is None else [out, torch.empty_like(x)]


@_op("embedding")
def embedding(ids: torch.Tensor, weight: torch.Tensor, weight_format: str, features: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a table in ``weight_format`` as ``[T, features]`` in ``dtype``: a
    table kept in blocks is decoded as it is gathered, never widened whole."""
    return weight.new_empty(ids.shape[0], features, dtype=dtype)


@_op("softmax_top_k")
def softmax_top_k(logits: torch.Tensor, k: int, normalize: bool, scale: float) -> list[torch.Tensor]:
    """A router's choice: ``[weights, ids]``, each ``[T, k]``, the k largest of each row's
    float32 softmax (``weights`` float32, the largest first), renormalised to sum to one
    where ``normalize``, times ``scale``. One op for what is otherwise four or five small
    kernels a layer (softmax, top-k, sum, division, scaling)."""
    rows = logits.shape[0]
    return [logits.new_empty(rows, k, dtype=torch.float32), logits.new_empty(rows, k, dtype=torch.int64)]


@_op("group_top_k")
def group_top_k(logits: torch.Tensor, correction_bias: torch.Tensor | None, k: int, n_group: int, topk_group: int,
                method: str, normalize: bool, scale: float) -> list[torch.Tensor]:
    """DeepSeek's grouped choice from float32 gate logits ``[T, E]``: ``[weights, ids]``, each
    ``[T, k]``. The experts form ``n_group`` groups of consecutive ids; only the
    ``topk_group`` best groups are kept. ``method`` is the config's ``topk_method``:
    ``group_limited_greedy`` (V2: softmax scores, a group ranked by its best score) or
    ``noaux_tc`` (V3: sigmoid scores, chosen with ``correction_bias`` added, a group ranked by
    the sum of its two best, weighed by the unbiased scores). Weights renormalised where
    ``normalize`` (``w / (sum + 1e-20)``), times ``scale``. One op for the seventeen small
    kernels a layer of plain ops (softmax or sigmoid, group maxima, two top-ks, a scatter,
    masks, a gather, the division) would launch at every decode step."""
    rows = logits.shape[0]
    return [logits.new_empty(rows, k, dtype=torch.float32), logits.new_empty(rows, k, dtype=torch.int64)]


@_op("route")
def route(x: torch.Tensor, weight: torch.Tensor, k: int, normalize: bool, scale: float,
          logits_dtype: torch.dtype | None = None, split_counters: torch.Tensor | None = None,
          correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          method: str = "greedy") -> list[torch.Tensor]:
    """A router's gate and choice in one op (a fusion pass's, for decode: one launch where a
    layer's routing took two or three): the gate's product ``x @ weight.T``, then
    ``softmax_top_k`` of it (``method`` greedy) or ``group_top_k`` (DeepSeek's
    ``group_limited_greedy`` and ``noaux_tc``, with ``correction_bias``, ``n_group`` and
    ``topk_group``). ``logits_dtype`` float32: the product of x and weight both cast to
    float32 (DeepSeek's gate, as transformers computes it); None: the linear layer's, in x's
    dtype. ``split_counters``: as ``linear``'s."""
    rows = x.shape[0]
    return [x.new_empty(rows, k, dtype=torch.float32), x.new_empty(rows, k, dtype=torch.int64)]


@_op("norm_route")
def norm_route(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
               weight: torch.Tensor, k: int, normalize: bool, scale: float, logits_dtype: torch.dtype | None = None,
               split_counters: torch.Tensor | None = None, correction_bias: torch.Tensor | None = None,
               n_group: int = 1, topk_group: int = 1, method: str = "greedy") -> list[torch.Tensor]:
    """``route`` of ``rms_norm(x + residual)``, which the mixture reads too: ``[weights, ids,
    normed, x + residual]`` (``[weights, ids, normed]`` without a residual). A decode step's
    routing normalises its input in the router's launch: the norm's own launch is gone."""
    rows = x.shape[0]
    choice = [x.new_empty(rows, k, dtype=torch.float32), x.new_empty(rows, k, dtype=torch.int64)]
    return [*choice, torch.empty_like(x)] + ([] if residual is None else [torch.empty_like(x)])


@_op("moe")
def moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor, shared: torch.Tensor | None = None, shared_w13: torch.Tensor | None = None,
        shared_w2: torch.Tensor | None = None) -> torch.Tensor:
    """A mixture of experts' routed MLPs: row t is the sum over j of ``topk_weights[t, j]``
    times expert ``e = topk_ids[t, j]``'s ``w2[e] @ silu_and_mul(w13[e] @ x[t])``
    (``w13``: ``[E, 2 * I, H]``, gate rows first; ``w2``: ``[E, H, I]``). Routing (softmax,
    top-k, renormalising, grouped top-k) is the model's, in plain ops before this one, so
    every model routes its own way through the same kernel. ``shared`` (a fusion pass's: the
    shared experts' output) is added to the result in x's dtype; or, given the shared
    experts' weights instead (``shared_w13 [2 * I_s, H]``, ``shared_w2 [H, I_s]``),
    ``gated_linear(linear(x, shared_w13), shared_w2)`` is."""
    return torch.empty_like(x)


# A recurrent (linear-attention) layer keeps a state per request in a slot of the model's
# state pools, ``[layer, slot, ...]``, as attention keeps pages: ``state_slots[row]`` is the
# slot of the row's request (as ``slot_mapping[row]`` is its cache slot), and slot 0 is the
# null slot that padding rows read as zeros and write. A request's rows are consecutive and
# in position order (``row_request`` tells them apart); a run of them that starts at
# position 0 starts from a zero state, any other run continues its slot's state, and every
# run leaves its last state in its slot.


@_op("causal_conv_silu", mutates_args=("conv_states",))
def causal_conv_silu(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, layer: int,
                     state_slots: torch.Tensor, row_request: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``silu`` of a depthwise causal convolution over each request's rows: x ``[rows, D]``,
    weight ``[D, W]``; ``conv_states [layers, slots, D, W]`` hold each request's last ``W``
    inputs (the oldest is not read again: fla's and transformers' layout)."""
    return torch.empty_like(x)


@_op("gated_delta_rule", mutates_args=("states",))
def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, layer: int, state_slots: torch.Tensor, row_request: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """Gated DeltaNet's recurrence over each request's rows: q, k ``[rows, H, K]``, v ``[rows,
    HV, V]`` (value head j reads key head ``j // (HV // H)``), the log decay ``g`` and ``beta``
    ``[rows, HV]``; per row, q and k L2-normalised, q scaled by ``K ** -0.5``, then
    ``S = exp(g) * S``, ``S += k (beta * (v - S^T k))^T``, out ``S^T q``. ``states [layers,
    slots, HV, K, V]`` float32. ``[rows, HV, V]`` in v's dtype."""
    return torch.empty_like(v)


@_op("causal_conv_silu_step", mutates_args=("conv_states",))
def causal_conv_silu_step(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, layer: int,
                          state_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``causal_conv_silu`` where every row is its own request's (decode): each continues its
    slot (from zeros at position 0 or on the null slot), with no read of the rows on the
    host, so a decode graph captures it. Padding rows all write the null slot."""
    return torch.empty_like(x)


@_op("gated_delta_rule_step", mutates_args=("states",))
def gated_delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          states: torch.Tensor, layer: int, state_slots: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
    """``gated_delta_rule`` where every row is its own request's, as ``causal_conv_silu_step``.
    CUDA's form updates the pool in place and starts a fresh row by decaying its slot to
    zero, so a fresh row's slot must hold finite values: the pools start zeroed and hold
    only states computed from them (in the engine, a decode step's fresh rows are its
    padding rows, on the null slot)."""
    return torch.empty_like(v)


OPS = torch.ops.tokenspeed
WRITE_KV = OPS.write_kv.default
ATTENTION = OPS.attention.default
EXTEND_ATTENTION = OPS.extend_attention.default
DECODE_ATTENTION = OPS.decode_attention.default
ROPE_DECODE_ATTENTION = OPS.rope_decode_attention.default
MLA_ATTENTION = OPS.mla_attention.default
MLA_DECODE_ATTENTION = OPS.mla_decode_attention.default
MLA_WRITE_DECODE_ATTENTION = OPS.mla_write_decode_attention.default
ATTENTION_TARGETS = (OPS.attention, ATTENTION, EXTEND_ATTENTION, DECODE_ATTENTION, ROPE_DECODE_ATTENTION,
                     OPS.mla_attention, MLA_ATTENTION, MLA_DECODE_ATTENTION, MLA_WRITE_DECODE_ATTENTION)
ROPE_WRITE_KV = OPS.rope_write_kv.default
ROPE = OPS.rope.default
MOE = OPS.moe.default
ROUTE = OPS.route.default
NORM_ROUTE = OPS.norm_route.default
SOFTMAX_TOP_K = OPS.softmax_top_k.default
GROUP_TOP_K = OPS.group_top_k.default
WRITE_LATENT = OPS.write_latent.default
NORM_ROPE_WRITE_LATENT = OPS.norm_rope_write_latent.default
CAUSAL_CONV_SILU, GATED_DELTA_RULE = OPS.causal_conv_silu.default, OPS.gated_delta_rule.default
# the recurrent ops over a step's runs: they read the runs on the host (eager, in breaks), and
# every row of a run reads the rows before it (the narrowing keeps them on every row)
RECURRENT_TARGETS = (OPS.causal_conv_silu, CAUSAL_CONV_SILU, OPS.gated_delta_rule, GATED_DELTA_RULE)
# the ops that write the cache (and need every row)
WRITE_KV_TARGETS = (OPS.write_kv, WRITE_KV, ROPE_WRITE_KV, OPS.write_latent, WRITE_LATENT, NORM_ROPE_WRITE_LATENT)
OP_NAMES = ("rope", "write_kv", "attention", "extend_attention", "decode_attention", "silu_and_mul",
            "rms_norm", "add_rms_norm", "rope_write_kv", "rope_decode_attention", "linear", "gated_linear",
            "norm_linear", "embedding", "softmax_top_k", "group_top_k", "route", "norm_route", "moe",
            "write_latent", "norm_rope_write_latent", "mla_attention", "mla_decode_attention",
            "mla_write_decode_attention", "causal_conv_silu", "gated_delta_rule",
            "causal_conv_silu_step", "gated_delta_rule_step")
