"""DeepSeek's router: which experts each token goes to, and with what weight.

Scores are float32 (as transformers keeps the gate). V2 scores by softmax and picks the
top k (``greedy``), or the top k of the ``topk_group`` groups with the highest best score
(``group_limited_greedy``). V3 (``noaux_tc``) scores by sigmoid, chooses with the
``e_score_correction_bias`` added (groups ranked by the sum of their two best), weighs
with the unbiased scores, normalised if ``norm_topk_prob``. Both scale the weights by
``routed_scaling_factor``. The greedy choice is one op (``tokenspeed::softmax_top_k``); the
grouped ones stay plain ops.
"""

import torch
from torch import nn

from tokenspeed.ir import ops
from tokenspeed.models.deepseek_config import DeepseekMoe


class DeepseekRouter(nn.Module):
    """``[rows, hidden]`` -> (weights ``[rows, k]`` float32, expert ids ``[rows, k]``)."""

    def __init__(self, hidden_size: int, moe: DeepseekMoe):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.n_routed_experts, hidden_size))
        if moe.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.n_routed_experts), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """The gate and its bias stay float32 whatever the model is cast to, as transformers
        keeps them (``_keep_in_fp32_modules_strict``): a bfloat16 gate routes some tokens
        elsewhere. The checkpoint's values are copied in after the cast, at full precision. A
        cast that leaves them on their device keeps the very float32 tensors (as
        ``layers.KeptFrequencies``): a cast of a loaded model must not round them."""
        kept = {name: p.data for name, p in self.named_parameters(recurse=False)}
        super()._apply(fn, recurse)
        for name, param in self.named_parameters(recurse=False):
            before = kept[name]
            unmoved = param.device == before.device and before.dtype == torch.float32
            param.data = before if unmoved else param.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x.float(), self.weight.float())
        scale = self.moe.routed_scaling_factor
        if self.moe.topk_method == "greedy":   # one op: softmax, top k, scaling
            weights, ids = ops.softmax_top_k(logits, self.moe.num_experts_per_tok, False, scale)
            return weights, ids
        if self.moe.topk_method == "noaux_tc":
            weights, ids = self._noaux_tc(logits.sigmoid())
        else:
            weights, ids = self._group_limited(logits.softmax(dim=-1))
        return weights * scale, ids

    def _group_limited(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        groups = scores.view(-1, self.moe.n_group, self.moe.n_routed_experts // self.moe.n_group).max(dim=-1).values
        scores = scores.masked_fill(~self._kept_experts(groups), 0.0)
        return torch.topk(scores, k=self.moe.num_experts_per_tok, dim=-1, sorted=False)

    def _noaux_tc(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        choice = scores + self.e_score_correction_bias.float()
        groups = choice.view(-1, self.moe.n_group, self.moe.n_routed_experts // self.moe.n_group)
        choice = choice.masked_fill(~self._kept_experts(groups.topk(2, dim=-1)[0].sum(dim=-1)), float("-inf"))
        ids = torch.topk(choice, k=self.moe.num_experts_per_tok, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.moe.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights, ids

    def _kept_experts(self, group_scores: torch.Tensor) -> torch.Tensor:
        """``[rows, experts]``: true for the experts of each row's ``topk_group`` best groups."""
        best = torch.topk(group_scores, k=self.moe.topk_group, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(group_scores).scatter(1, best, 1.0).bool()
        per_group = self.moe.n_routed_experts // self.moe.n_group
        return kept[:, :, None].expand(-1, -1, per_group).reshape(kept.shape[0], -1)
