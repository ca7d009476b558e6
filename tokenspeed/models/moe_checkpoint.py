"""Where a mixture of experts' checkpoint tensors go: each expert's matrices, stored one
by one (``experts.{e}.w1/w3/w2`` in Mixtral, ``experts.{e}.gate_proj/up_proj/down_proj``
in Qwen3-MoE), into their slices of the stacked ``experts.w13`` and ``experts.w2``; and
Mixtral's ``block_sparse_moe`` read as ``mlp`` (as transformers 5 renames it).

The loader marks each slice it fills by a key (``experts.w13#e.part``), so a missing
expert is named as the checkpoint stores it.
"""

import re

import attrs
import torch

from tokenspeed.models.moe_config import MIXTRAL

EXPERT = re.compile(r"^(?P<prefix>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\."
                    r"(?P<part>w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$")
PARTS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
         "w2": ("w2", 0), "down_proj": ("w2", 0)}
STACKED_PARTS = {"w13": 2, "w2": 1}   # each expert's parts in a stacked tensor
PART_NAMES = {MIXTRAL: ("w1", "w3", "w2")}   # gate, up, down as an architecture stores them
DEFAULT_PART_NAMES = ("gate_proj", "up_proj", "down_proj")   # Qwen3-MoE's, and most others'
FUSED = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}


@attrs.frozen
class ExpertPiece:
    """One expert's matrix: its slice ``part`` of expert ``expert`` in the parameter ``param``."""
    param: str
    expert: int
    part: int

    @property
    def key(self) -> str:
        return f"{self.param}#{self.expert}.{self.part}"

    def target(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        stacked = params[self.param][self.expert]
        return stacked.chunk(STACKED_PARTS[self.param.rsplit(".", 1)[1]])[self.part]


def our_name(name: str) -> str:
    """Mixtral's ``block_sparse_moe`` as ``mlp``; the fused experts of transformers 5's own
    modules (``experts.gate_up_proj [E, 2I, H]``, gate rows first, and ``experts.down_proj
    [E, H, I]``, what its ``state_dict()`` holds) as the stacked tensors they equal."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    fused = next((f for f in FUSED if name.endswith(f)), None)
    return name if fused is None else name.removesuffix(fused) + FUSED[fused]


def stored_name(name: str, architecture: str) -> str:
    """``our_name`` undone: Mixtral's every MLP is its ``block_sparse_moe``."""
    return name.replace(".mlp.", ".block_sparse_moe.") if architecture == MIXTRAL else name


def expert_piece(name: str) -> ExpertPiece | None:
    """The slice a checkpoint tensor fills, if it is an expert's matrix."""
    found = EXPERT.match(name)
    if found is None:
        return None
    param, part = PARTS[found["part"]]
    return ExpertPiece(f"{found['prefix']}.mlp.experts.{param}", int(found["expert"]), part)


def expected_keys(name: str, param: torch.Tensor) -> list[str] | None:
    """The keys of a stacked experts parameter's slices (``None``: not one)."""
    kind = name.rsplit(".", 1)[1]
    if ".experts." not in name or kind not in STACKED_PARTS:
        return None
    return [ExpertPiece(name, e, p).key for e in range(param.shape[0]) for p in range(STACKED_PARTS[kind])]


def checkpoint_name(key: str, architecture: str) -> str:
    """``...mlp.experts.w13#3.1`` -> ``...mlp.experts.3.up_proj.weight`` (Mixtral:
    ``...block_sparse_moe.experts.3.w3.weight``)."""
    name, slot = key.split("#")
    expert, part = slot.split(".")
    prefix, kind = name.rsplit(".", 1)
    gate, up, down = PART_NAMES.get(architecture, DEFAULT_PART_NAMES)
    stored = {("w13", "0"): gate, ("w13", "1"): up, ("w2", "0"): down}[(kind, part)]
    return stored_name(f"{prefix}.{expert}.{stored}.weight", architecture)


def expert_tensors(name: str, stacked: torch.Tensor, architecture: str) -> dict[str, torch.Tensor]:
    """A stacked experts parameter as the checkpoint stores it, one matrix an expert and part."""
    parts = STACKED_PARTS[name.rsplit(".", 1)[1]]
    return {checkpoint_name(ExpertPiece(name, e, p).key, architecture): piece.contiguous()
            for e in range(stacked.shape[0]) for p, piece in enumerate(stacked[e].chunk(parts))}
