"""The torch reference of ``tokenspeed::moe``: what the CPU runs, and the oracle of the
fused Triton kernel (``triton_moe``).

Each expert computes the rows routed to it and nothing else, as a mixture of experts is
defined (and as transformers computes it): a token's expert output is multiplied by its
routing weight and added into the token's row in float32, so the k contributions of a
row are summed at full precision whatever the activations' dtype.
"""

import torch


def moe(x, w13, w2, topk_weights, topk_ids, shared=None):
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in topk_ids.unique().tolist():
        rows, choice = (topk_ids == expert).nonzero(as_tuple=True)
        routed = expert_mlp(x[rows], w13[expert], w2[expert])
        out.index_add_(0, rows, routed.float() * topk_weights[rows, choice, None].float())
    return out.to(x.dtype) if shared is None else out.to(x.dtype) + shared


def expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SiLU-gated MLP on the rows ``x`` routed to it (``w13``: gate rows, then up)."""
    gate, up = torch.nn.functional.linear(x, w13).chunk(2, dim=-1)
    return torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2)
