"""Routed experts stored one by one (``...experts.{e}.gate_proj.weight``, as transformers
saves DeepSeek checkpoints) loaded into the stacked weights ``tokenspeed::moe`` reads:
``experts.w13 [E, 2 * I, H]`` (gate rows, then up) and ``experts.w2 [E, H, I]``.

Each stored expert matrix is one part of a stacked parameter, named ``param#e.part``
(``...experts.w13#3.up_proj``), so the loader can tell which are missing.
"""

import re

import torch

STORED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")
STACKED_BY_PART = {"gate_proj": "w13", "up_proj": "w13", "down_proj": "w2"}
PARTS_OF = {"w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}


def expert_part(params: dict[str, torch.Tensor], name: str) -> tuple[str, torch.Tensor] | None:
    """(part key, the slice of the stacked parameter it fills) for a stored expert matrix,
    None for any other name (or a model without stacked experts there)."""
    found = STORED.match(name)
    if found is None:
        return None
    stacked = f"{found['prefix']}.{STACKED_BY_PART[found['part']]}"
    if stacked not in params:
        return None
    expert, part = int(found["expert"]), found["part"]
    rows = params[stacked][expert]
    if stacked.endswith(".w13"):
        rows = rows.chunk(2, dim=0)[part == "up_proj"]
    return f"{stacked}#{expert}.{part}", rows


def part_keys(name: str, param: torch.Tensor) -> list[str]:
    """The part keys a stacked expert parameter is filled by ([] for any other parameter)."""
    kind = name.rpartition(".")[2]
    if not name.rpartition(".")[0].endswith(".experts") or kind not in PARTS_OF:
        return []
    return [f"{name}#{e}.{part}" for e in range(param.shape[0]) for part in PARTS_OF[kind]]


def stored_name(key: str) -> str:
    """``...experts.w13#3.up_proj`` -> ``...experts.3.up_proj.weight``."""
    stacked, _, rest = key.partition("#")
    expert, _, part = rest.partition(".")
    return f"{stacked.rpartition('.')[0]}.{expert}.{part}.weight"
