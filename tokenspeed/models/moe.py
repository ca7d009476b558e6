"""The sparse mixture-of-experts block of Mixtral and Qwen3-MoE: a router, then the
experts through ``tokenspeed::moe``.

The router is a linear layer's logits, then ``tokenspeed::softmax_top_k``, as transformers
routes: their softmax in float32, the top k, renormalised over those k where the config
says so. The experts are two stacked tensors, ``w13 [E, 2 * I, H]`` (each expert's gate
rows, then its up rows) and ``w2 [E, H, I]``, filled at load from the checkpoint's
per-expert matrices (``moe_checkpoint``), so one kernel reads every expert.
"""

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.models.moe_config import MoeConfig


class Experts(nn.Module):
    """Every routed expert's weights stacked as ``tokenspeed::moe`` reads them (transformers
    5's ``gate_up_proj`` and ``down_proj``): ``w13 [E, 2 * I, H]``, ``w2 [E, H, I]``."""

    def __init__(self, num_experts: int, intermediate_size: int, hidden_size: int):
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, moe: MoeConfig, hidden_size: int):
        super().__init__()
        self.top_k, self.normalize_top_k = moe.top_k, moe.normalize_top_k
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(moe.num_experts, moe.intermediate_size, hidden_size)

    def forward(self, x):
        weights, ids = ops.softmax_top_k(self.gate(x), self.top_k, self.normalize_top_k, 1.0)
        return ops.moe(x, self.experts.w13, self.experts.w2, weights, ids)
