"""The torch reference of ``tokenspeed::group_top_k``, DeepSeek's grouped routing: what the
CPU runs, and the oracle of ``triton_group_route``.

These are transformers' own steps (``DeepseekV2Moe`` / ``DeepseekV3TopkRouter``), so the
CPU routes every token as transformers does, ties and unsorted top-ks included: V2's
``group_limited_greedy`` keeps the ``topk_group`` groups with the highest best softmax score
and zeroes the others' scores; V3's ``noaux_tc`` adds the score-correction bias to the
sigmoid scores for the choice only, ranks a group by the sum of its two best, drops the
other groups' experts from the choice and weighs by the unbiased scores.
"""

import torch

from tokenspeed.errors import InternalError

METHODS = ("group_limited_greedy", "noaux_tc")


def group_top_k(logits, correction_bias, k, n_group, topk_group, method, normalize, scale):
    check(tuple(logits.shape), correction_bias, k, n_group, topk_group, method)
    if method == "noaux_tc":
        weights, ids = _noaux_tc(logits.float().sigmoid(), correction_bias, k, n_group, topk_group)
    else:
        weights, ids = _group_limited(logits.float().softmax(dim=-1), k, n_group, topk_group)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return [weights * scale, ids]


def _group_limited(scores, k, n_group, topk_group):
    groups = scores.view(scores.shape[0], n_group, scores.shape[1] // n_group).max(dim=-1).values
    scores = scores.masked_fill(~kept_experts(groups, topk_group, scores.shape[1]), 0.0)
    return torch.topk(scores, k=k, dim=-1, sorted=False)


def _noaux_tc(scores, correction_bias, k, n_group, topk_group):
    choice = scores + correction_bias.float()
    groups = choice.view(scores.shape[0], n_group, scores.shape[1] // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    choice = choice.masked_fill(~kept_experts(groups, topk_group, scores.shape[1]), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    return scores.gather(1, ids), ids


def kept_experts(group_scores: torch.Tensor, topk_group: int, experts: int) -> torch.Tensor:
    """``[rows, experts]``: true for the experts of each row's ``topk_group`` best groups."""
    best = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    kept = torch.zeros_like(group_scores).scatter(1, best, 1.0).bool()
    return kept[:, :, None].expand(-1, -1, experts // group_scores.shape[1]).reshape(kept.shape[0], experts)


def check(shape: tuple, correction_bias, k: int, n_group: int, topk_group: int, method: str) -> None:
    """The choice's arguments as transformers' routing accepts them (a kernel's own limits aside)."""
    if method not in METHODS:
        raise InternalError(f"group_top_k's method is one of {list(METHODS)}; got {method!r}")
    if len(shape) != 2 or n_group < 1 or shape[1] % n_group or not 0 < topk_group <= n_group:
        raise InternalError(f"group_top_k wants logits [T, E] in n_group groups of equal size and 0 < topk_group "
                            f"<= n_group; got {shape}, n_group={n_group}, topk_group={topk_group}")
    per_group = shape[1] // n_group
    if not 0 < k <= topk_group * per_group:
        raise InternalError(f"group_top_k's k={k} must be in [1, {topk_group * per_group}] (topk_group={topk_group} "
                            f"groups of {per_group} experts)")
    if method == "noaux_tc" and (per_group < 2 or correction_bias is None or correction_bias.shape != shape[1:]):
        raise InternalError(f"noaux_tc ranks groups of at least 2 experts and adds a correction bias [{shape[1]}]; "
                            f"got groups of {per_group} and a bias "
                            f"{None if correction_bias is None else tuple(correction_bias.shape)}")
