"""Which values of a graph are token-row shaped.

Shapes are propagated twice on fake tensors with two different row counts; a value
whose leading dimension follows the row count is row-shaped. Nothing about the model is
assumed beyond the descriptor's inputs.
"""

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

PROBE_ROWS = (5, 7)
PROBE_TABLE_ROWS, PROBE_SAMPLED, PROBE_PAGES, PROBE_PAGE_SIZE = 3, 2, 4, 4


def example_inputs(config, rows: int, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Small inputs of the traced signature, with ``rows`` token rows."""
    cache = (config.num_layers, 2, PROBE_PAGES, PROBE_PAGE_SIZE, config.num_kv_heads, config.head_dim)
    long = dict(dtype=torch.int64, device=device)
    return {
        "kv_cache": torch.zeros(cache, dtype=dtype, device=device),
        "input_ids": torch.zeros(rows, **long), "positions": torch.zeros(rows, **long),
        "slot_mapping": torch.zeros(rows, **long),
        "block_tables": torch.zeros(PROBE_TABLE_ROWS, 2, dtype=torch.int32, device=device),
        "row_request": torch.zeros(rows, **long), "sample_rows": torch.zeros(PROBE_SAMPLED, **long),
        "view_rows": torch.zeros(rows, **long), "view_sample_rows": torch.zeros(PROBE_SAMPLED, **long),
    }


def fake_values(gm: fx.GraphModule, config, rows: int) -> dict[str, object]:
    """Every node's value (fake tensors: shapes and dtypes only) on ``rows`` token rows."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    weights = [*gm.parameters(), *gm.buffers()]
    inputs = example_inputs(config, rows, weights[0].device if weights else "cpu")
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    with mode:
        fakes = [mode.from_tensor(inputs[n]) for n in names]
    FakeTensorProp(gm, mode).propagate(*fakes)
    return {n.name: n.meta.get("val") for n in gm.graph.nodes}


def leading_dims(gm: fx.GraphModule, config, rows: int) -> dict[str, int | None]:
    return {name: _dim0(value) for name, value in fake_values(gm, config, rows).items()}


def row_shaped(gm: fx.GraphModule, config) -> set[str]:
    first, second = (leading_dims(gm, config, r) for r in PROBE_ROWS)
    return {name for name, d in first.items() if d == PROBE_ROWS[0] and second[name] == PROBE_ROWS[1]}


def _dim0(value) -> int | None:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None
