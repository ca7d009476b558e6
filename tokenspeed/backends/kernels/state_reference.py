"""The torch references of the recurrent layers' ops (``causal_conv_silu``,
``gated_delta_rule``): what the CPU runs and the oracle of the GPU's kernels.

A step's rows are cut into runs, one per request (``runs``); each run is computed on its
own, a token at a time, from its slot's state (or zeros), and leaves its last state in
the slot. The recurrence is transformers' recurrent form of Qwen3-Next's gated DeltaNet
(``torch_recurrent_gated_delta_rule``), the convolution its ``causal_conv1d_update``: a
prompt computed here in chunks equals the whole prompt at once, up to float32 rounding.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenspeed.backends.metadata import NULL_SLOT


class Run(NamedTuple):
    """Rows ``[start, end)`` of one request, its state slot, and whether it starts from zeros."""
    start: int
    end: int
    slot: int
    fresh: bool


def runs(state_slots: torch.Tensor, row_request: torch.Tensor, positions: torch.Tensor) -> list[Run]:
    """The step's runs (a host read of the metadata: the references' and eager kernels'
    way). A run at position 0, or on the null slot, starts from zeros."""
    if row_request.numel() == 0:
        return []
    _, counts = torch.unique_consecutive(row_request, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    slots = state_slots[starts].tolist() if starts else []
    first = positions[starts].tolist() if starts else []
    return [Run(s, e, slot, p == 0 or slot == NULL_SLOT) for s, e, slot, p in zip(starts, ends, slots, first)]


def causal_conv_silu(x, weight, conv_states, layer, state_slots, row_request, positions):
    out = torch.empty_like(x)
    width = weight.shape[1]
    for run in runs(state_slots, row_request, positions):
        state = conv_states[layer, run.slot]
        before = torch.zeros_like(state) if run.fresh else state
        window = torch.cat([before.to(weight.dtype), x[run.start:run.end].T.to(weight.dtype)], dim=1)
        conv = F.conv1d(window[None, :, 1:], weight[:, None], groups=weight.shape[0])[0]     # [D, n]
        out[run.start:run.end] = F.silu(conv).T.to(x.dtype)
        state.copy_(window[:, window.shape[1] - width:])
    return out


def l2_normalized(x: torch.Tensor) -> torch.Tensor:
    """As transformers' (and fla's) ``l2norm``: ``x / sqrt(sum(x^2) + 1e-6)``."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def gated_delta_rule(q, k, v, g, beta, states, layer, state_slots, row_request, positions):
    out = torch.empty_like(v)
    groups = v.shape[1] // q.shape[1]
    q = l2_normalized(q.float().repeat_interleave(groups, 1)) * q.shape[-1] ** -0.5
    k = l2_normalized(k.float().repeat_interleave(groups, 1))
    for run in runs(state_slots, row_request, positions):
        state = torch.zeros_like(states[layer, run.slot]) if run.fresh else states[layer, run.slot].float()
        for t in range(run.start, run.end):
            state = state * g[t].float().exp()[:, None, None]
            remembered = (state * k[t][..., None]).sum(-2)                              # [HV, V]
            delta = (v[t].float() - remembered) * beta[t].float()[:, None]
            state = state + k[t][..., None] * delta[:, None, :]
            out[t] = (state * q[t][..., None]).sum(-2).to(v.dtype)
        states[layer, run.slot] = state
    return out


def continued(pool: torch.Tensor, layer: int, state_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's state from its slot, float32; zeros for a row at position 0 or on the
    null slot (selected, not multiplied: a slot never written may hold NaN)."""
    fresh = ((positions == 0) | (state_slots == NULL_SLOT)).view(-1, *([1] * (pool.dim() - 2)))
    state = pool[layer].index_select(0, state_slots).float()
    return torch.where(fresh, torch.zeros((), device=pool.device), state)


def causal_conv_silu_step(x, weight, conv_states, layer, state_slots, positions):
    """One row per request: its window is its slot's last ``W - 1`` inputs and its own."""
    before = continued(conv_states, layer, state_slots, positions)                   # [rows, D, W]
    window = torch.cat([before[:, :, 1:], x.float()[:, :, None]], dim=2)
    out = F.silu((window * weight.float()[None]).sum(-1))
    conv_states[layer].index_copy_(0, state_slots, window.to(conv_states.dtype))
    return out.to(x.dtype)


def gated_delta_rule_step(q, k, v, g, beta, states, layer, state_slots, positions):
    """One row per request: one step of the recurrence from its slot's state."""
    groups = v.shape[1] // q.shape[1]
    q = l2_normalized(q.float().repeat_interleave(groups, 1)) * q.shape[-1] ** -0.5
    k = l2_normalized(k.float().repeat_interleave(groups, 1))
    state = continued(states, layer, state_slots, positions) * g.float().exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)                                           # [rows, HV, V]
    delta = (v.float() - remembered) * beta.float()[..., None]
    state = state + k[..., None] * delta[:, :, None, :]
    states[layer].index_copy_(0, state_slots, state)
    return (state * q[..., None]).sum(-2).to(v.dtype)
