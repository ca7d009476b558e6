"""DeepSeek's router: which experts each token goes to, and with what weight.

Scores are float32 (as transformers keeps the gate). V2 scores by softmax and picks the
top k (``greedy``), or the top k of the ``topk_group`` groups with the highest best score
(``group_limited_greedy``). V3 (``noaux_tc``) scores by sigmoid, chooses with the
``e_score_correction_bias`` added (groups ranked by the sum of their two best), weighs
with the unbiased scores, normalised if ``norm_topk_prob``. Both scale the weights by
``routed_scaling_factor``. Each choice is one op: ``tokenspeed::softmax_top_k`` (greedy) or
``tokenspeed::group_top_k`` (the grouped ones, whose reference holds the steps above).
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
        moe, scale = self.moe, self.moe.routed_scaling_factor
        if moe.topk_method == "greedy":   # one op: softmax, top k, scaling
            weights, ids = ops.softmax_top_k(logits, moe.num_experts_per_tok, False, scale)
            return weights, ids
        bias = self.e_score_correction_bias if moe.topk_method == "noaux_tc" else None
        weights, ids = ops.group_top_k(logits, bias, moe.num_experts_per_tok, moe.n_group, moe.topk_group,
                                       moe.topk_method, moe.norm_topk_prob, scale)
        return weights, ids
