"""The recurrent layers' ops on CUDA through ``flash-linear-attention`` (``fla-core``):
its chunked gated delta rule and its causal convolution, written and tuned by the people
who made these layers; none is written here.

fla's chunked kernels take a batch as sequences laid end to end (``cu_seqlens``) with one
initial state per sequence, and return their final states: each prefill call gathers its
runs' states from their slots (zeros for a run that starts fresh) and scatters the final
states back. The runs are read on the host (``state_reference.runs``), so these kernels run
eagerly, in the prefill's breaks. A decode step, whose runs are its rows, needs no such
read, and its recurrence updates the pool in place by slot.
"""

import torch

from tokenspeed.backends.kernels.state_reference import runs
from tokenspeed.backends.metadata import NULL_SLOT


def _layout(state_slots, row_request, positions):
    """(cu_seqlens, slots, keep) of the step's runs on the device: ``keep`` is 0 where a run
    starts from zeros."""
    cut = runs(state_slots, row_request, positions)
    device = row_request.device
    cu = torch.tensor([0] + [r.end for r in cut], dtype=torch.int64, device=device)
    slots = torch.tensor([r.slot for r in cut], dtype=torch.int64, device=device)
    keep = torch.tensor([not r.fresh for r in cut], dtype=torch.bool, device=device)
    return cu, slots, keep


def _initial(pool: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The runs' states, zeros where a run starts fresh (selected, not multiplied: a slot
    never written may hold any bits, NaN among them)."""
    initial = pool.index_select(0, slots)
    return torch.where(keep.view(-1, *[1] * (initial.dim() - 1)), initial, torch.zeros_like(initial))


def causal_conv_silu(x, weight, conv_states, layer, state_slots, row_request, positions):
    from fla.modules.causal_conv1d import causal_conv1d
    if x.shape[0] == 0:
        return torch.empty_like(x)
    cu, slots, keep = _layout(state_slots, row_request, positions)
    pool = conv_states[layer]
    y, final = causal_conv1d(x.contiguous()[None], weight.contiguous(), initial_state=_initial(pool, slots, keep),
                             output_final_state=True, activation="silu", cu_seqlens=cu)
    pool.index_copy_(0, slots, final.to(pool.dtype))
    return y[0]


def gated_delta_rule(q, k, v, g, beta, states, layer, state_slots, row_request, positions):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    if q.shape[0] == 0:
        return torch.empty_like(v)
    cu, slots, keep = _layout(state_slots, row_request, positions)
    pool = states[layer]
    q, k, v, g, beta = (t.contiguous()[None] for t in (q, k, v, g.float(), beta))   # fla's layout: [1, T, ...]
    o, final = chunk_gated_delta_rule(q, k, v, g, beta,
                                      scale=k.shape[-1] ** -0.5, initial_state=_initial(pool, slots, keep),
                                      output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    pool.index_copy_(0, slots, final.float())
    return o[0].to(v.dtype)   # fla's output is in q's dtype; the op's, v's



def gated_delta_rule_step(q, k, v, g, beta, states, layer, state_slots, positions):
    """One row a request (decode), through fla's serving form of the recurrence (Kimi delta
    attention's, whose decay per key channel is Gated DeltaNet's per head repeated over the
    channels): each row reads and writes its state in the pool by slot, one pass over it,
    with nothing gathered or scattered and nothing read on the host (the step is captured).
    A fresh row (position 0, or the null slot) decays by exp(-inf) = 0 before its first
    write: zeros from any finite slot (``ops.gated_delta_rule_step`` says why every slot is)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    if q.shape[0] == 0:
        return torch.empty_like(v)
    fresh = (positions == 0) | (state_slots == NULL_SLOT)
    decay = torch.where(fresh[:, None], float("-inf"), g.float())
    decay = decay[:, None, :, None].expand(-1, 1, -1, q.shape[-1]).contiguous()     # [rows, 1, HV, K]
    q, k, v, beta = (t.contiguous()[:, None] for t in (q, k, v, beta))               # [rows, 1, ...]
    o, _ = fused_recurrent_kda_fwd(q, k, v, decay, beta, scale=k.shape[-1] ** -0.5, initial_state=states[layer],
                                   inplace_final_state=True, ssm_state_indices=state_slots,
                                   use_qk_l2norm_in_kernel=True)
    return o[:, 0]
