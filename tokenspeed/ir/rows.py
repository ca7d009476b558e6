"""Which values of a graph are token-row shaped.

Shapes are propagated twice, with two different row counts, on meta tensors (the weights
swapped for meta copies: shapes and dtypes only, no memory, no kernels); a value whose
leading dimension follows the row count is row-shaped. Nothing about the model is
assumed beyond the descriptor's inputs. The IR's ops run on meta tensors through their
shape functions.
"""

import torch
from torch import fx

from tokenspeed.ir.cache_groups import rows_per_page

PROBE_ROWS = (5, 7)
PROBE_HELD = 11   # the other ladder's rows while one is probed
PROBE_TABLE_ROWS, PROBE_SAMPLED, PROBE_PAGES, PROBE_PAGE_SIZE, PROBE_TILES = 3, 2, 4, 4, 3


def example_inputs(config, rows: int, device="meta", dtype=torch.float32,
                   view_rows: int | None = None) -> dict[str, torch.Tensor]:
    """Small inputs of the traced signature, with ``rows`` token rows (and as many decoder
    view rows unless ``view_rows``)."""
    views = rows if view_rows is None else view_rows
    g = len(config.cache_groups)
    parts, heads, values = config.cache_row
    cache = (rows_per_page(config.cache_groups), parts, PROBE_PAGES, PROBE_PAGE_SIZE, heads, values)
    long = dict(dtype=torch.int64, device=device)
    return {
        "kv_cache": torch.zeros(cache, dtype=dtype, device=device),
        "input_ids": torch.zeros(rows, **long), "positions": torch.zeros(rows, **long),
        "slot_mapping": torch.zeros((rows, g) if g > 1 else (rows,), **long),
        "block_tables": torch.zeros((PROBE_TABLE_ROWS, g, 2) if g > 1 else (PROBE_TABLE_ROWS, 2),
                                    dtype=torch.int32, device=device),
        "row_request": torch.zeros(rows, **long), "state_slots": torch.zeros(rows, **long),
        "sample_rows": torch.zeros(PROBE_SAMPLED, **long),
        "view_rows": torch.zeros(views, **long), "view_sample_rows": torch.zeros(PROBE_SAMPLED, **long),
        "attention_tiles": torch.zeros(PROBE_TILES, dtype=torch.int32, device=device),
        "view_attention_tiles": torch.zeros(PROBE_TILES, dtype=torch.int32, device=device),
    }


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm)
        self.values = {}

    def run_node(self, node):
        self.values[node.name] = value = super().run_node(node)
        return value


def fake_values(gm: fx.GraphModule, config, rows: int, view_rows: int | None = None) -> dict[str, object]:
    """Every node's value (meta tensors: shapes and dtypes only) on ``rows`` token rows
    (and ``view_rows`` decoder view rows: as many by default). The weights are swapped
    for meta copies once for the whole run (per module call, the swaps took most of a
    lowering's time), and put back in the reverse order: a module reachable by two names
    would otherwise keep a meta copy."""
    state = {n: torch.empty_like(t, device="meta")
             for n, t in [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers()]}
    inputs = example_inputs(config, rows, view_rows=view_rows)
    recorder = _Recorder(gm)
    with torch.nn.utils.stateless._reparametrize_module(gm, state, stack_weights=True):
        recorder.run(*[inputs[n.name] for n in gm.graph.nodes if n.op == "placeholder"])
    return recorder.values


def leading_dims(gm: fx.GraphModule, config, rows: int, view_rows: int | None = None) -> dict[str, int | None]:
    return {name: _dim0(value) for name, value in fake_values(gm, config, rows, view_rows).items()}


def row_shaped(gm: fx.GraphModule, config) -> set[str]:
    """The values with a row per token row (or per view row: the two probes move together)."""
    return _following(gm, config, lambda r: (r, None))


def rows_by_ladder(gm: fx.GraphModule, config) -> dict[str, set[str]]:
    """``{"tokens": ..., "view": ...}``: the values whose leading dimension follows the token
    rows, and those that follow the decoder view's rows (each probed with the other held
    at ``PROBE_HELD``), for a program with both (a narrowed prefill)."""
    return {"tokens": _following(gm, config, lambda r: (r, PROBE_HELD)),
            "view": _following(gm, config, lambda r: (PROBE_HELD, r))}


def _following(gm: fx.GraphModule, config, counts) -> set[str]:
    """The values whose leading dimension is the probed count at both ``PROBE_ROWS``;
    ``counts(r)``: the (token rows, view rows) of the probe at ``r``."""
    first, second = (leading_dims(gm, config, *counts(r)) for r in PROBE_ROWS)
    return {name for name, d in first.items() if d == PROBE_ROWS[0] and second[name] == PROBE_ROWS[1]}


def _dim0(value) -> int | None:
    return value.shape[0] if isinstance(value, torch.Tensor) and value.dim() > 0 else None
