"""The GGUF linear kernels per block format, at the 1B shape's projections (the down
projection, N 2048 x K 8192, unless ``--projections`` names others), against a bf16 torch
matmul and bf16 split-K GEMV (fp32 under ``--tiny``) and the bytes-read floor.

    python -m benchmarks.gguf_gemv [--rows 1 32 2048] [--json results/gguf_gemv.json]
    python -m benchmarks.gguf_gemv --tiny        (CPU: the Triton interpreter, small shape)
    python -m benchmarks.gguf_gemv --sweep --formats Q4_K --rows 1 32 --projections all

On a GPU each timing replays a CUDA graph of back-to-back calls over distinct weight copies
(more bytes than L2 holds), as a decode step streams its layers. One row goes through the
matrix-vector kernel, more through the tensor-core kernel (``triton_gguf_matmul.linear``);
2048 rows is a prefill's.
The floor is the weight's bytes over the measured device-to-device copy bandwidth. Weights
are random blocks with finite fp16 scales: the values do not change the time. ``--tiny``
only checks that the benchmark runs (interpreter times mean nothing). ``--sweep`` times the
kernel's other configs (``config`` column; the chosen one is ``chosen``; one row of a wide
Q4_K or Q8_0_G8 weight: the unit GEMV's and the wide GEMV's, ``triton_gguf_wide``; a Q4_K
matmul's also with byte-pair tiles), prints each shape's best and, per format and row count,
the model's linears a token (every layer's projections and the head once, of those timed) at
the chosen configs and at each shape's best: hundreds of compiles a projection (Q4_K at 32
rows: 576), so name the projections and formats you need.
"""

import argparse
import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs  # noqa: E402
import triton  # noqa: E402

from benchmarks import common  # noqa: E402
from tokenspeed.backends.kernels import triton_attention, triton_gemv  # noqa: E402
from tokenspeed.backends.kernels import triton_gguf_gemv, triton_gguf_matmul, triton_gguf_wide  # noqa: E402
from tokenspeed.backends.kernels.gguf_blocks import GATHERED, SUPPORTED, BlockFormat, Q, block_format  # noqa: E402
from tokenspeed.ir.weights import WIDE_ROWS  # noqa: E402

TINY_SHAPE = (48, 512)
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), GATHERED: tuple(range(0, 16, 2))}  # fp16 fields' bytes


def random_blocks(fmt: BlockFormat, n: int, k: int, device) -> torch.Tensor:
    """``uint8 [n, row_bytes]``: random bytes, with each fp16 scale set to a modest value."""
    blocks = torch.randint(0, 256, (n, k // fmt.block_size, fmt.type_size), dtype=torch.uint8,
                           device=device)
    for offset in HALVES[fmt.name]:
        scales = (torch.rand(n, k // fmt.block_size, 1, device=device) * 0.02).half()
        blocks[..., offset:offset + 2] = scales.view(torch.uint8)
    return blocks.reshape(n, -1)


def measure(fmt: BlockFormat, m: int, shape, tiny: bool, device, bandwidth,
            config=None) -> dict:
    """``linear`` as the engine calls it, or (``config``) its kernel for that config."""
    n, k = shape
    dtype = torch.float32 if tiny else torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype)
    weights = common.weight_copies(lambda: random_blocks(fmt, n, k, device), n * fmt.row_bytes(k), tiny)
    us = common.time_chain(weights, kernel(x, fmt, config), tiny) * 1e6
    nbytes = weights[0].numel()
    floor = nbytes / bandwidth * 1e6 if bandwidth else None
    return {"format": fmt.name, "rows": m, "n": n, "k": k, "mb": nbytes / 1e6, "us": us,
            "floor_us": floor, "of_floor": floor / us if floor else None,
            "config": "chosen" if config is None else _describe(config)}


def kernel(x, fmt: BlockFormat, config):
    """weight -> output: ``linear``, or the GEMV or matmul that ``config`` configures."""
    if config is None:
        return lambda w: triton_gguf_matmul.linear(x, w, fmt)
    if isinstance(config, triton_gguf_gemv.GemvConfig):
        return lambda w: triton_gguf_gemv.gemv(x, w, fmt, config=config)
    if isinstance(config, triton_gguf_wide.WideConfig):
        return lambda w: triton_gguf_wide.gemv(x, w, fmt, config=config)
    return lambda w: triton_gguf_matmul.matmul(x, w, fmt, config=config)


def projections(config: dict) -> dict:
    """A model's linear weights as ``name: (N, K)``: the fused qkv and gate/up, the output
    and down projections, and the head."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"qkv": (q + 2 * kv, hidden), "o": (hidden, q), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "head": (config["vocab_size"], hidden)}


PROJECTIONS = projections(common.SHAPES["llama-3.2-1b"])


def candidates(fmt: BlockFormat, m: int, shape, sm_count: int) -> list:
    """The configs ``--sweep`` times for ``m`` rows of a ``shape`` (N, K) weight: every
    grid point of tiles, warps, stages and splits (a Q4_K matmul's with byte-pair tiles and
    without), less splits shorter than a tile and splits of weights whose column blocks
    alone fill the GPU several times."""
    n, k = shape
    if m == 1:
        grid = itertools.product([1, 2, 4, 8], [512, 1024, 2048, 4096], [1, 2, 4, 8], [1, 2, 4])
        units = [triton_gguf_gemv.GemvConfig(bn, tile, splits, warps) for bn, tile, splits, warps in grid
                 if tile <= k // splits and (splits == 1 or triton.cdiv(n, bn) < 8 * sm_count)]
        return units + wide_candidates(fmt, shape)
    if m > triton_gguf_matmul.SKINNY_M:
        grid = itertools.product([64, 128], [64], [4, 8], [3, 4])
        return [triton_gguf_matmul.MatmulConfig(128, bn, tile // fmt.group_size, 1, warps, stages)
                for bn, tile, warps, stages in grid]
    block_m = max(16, triton.next_power_of_2(m))
    grid = itertools.product([32, 64, 128], [64, 128], [1, 2, 3, 4, 8, 16], [4, 8], [2, 3, 4, 5],
                             [False, True] if fmt.qtype == Q.Q4_K else [False])
    return [triton_gguf_matmul.MatmulConfig(block_m, bn, tile // fmt.group_size, splits, warps, stages, pairs)
            for bn, tile, splits, warps, stages, pairs in grid
            if (tile == 64 or block_m <= 32) and tile <= k // splits
            and (splits == 1 or triton.cdiv(n, bn) * splits <= 8 * sm_count)]


def wide_candidates(fmt: BlockFormat, shape) -> list:
    """One row of a weight the wide GEMV serves (``triton_gguf_wide``): its row blocks,
    tiles, warps and stages, tiles no longer than K."""
    n, k = shape
    if n < WIDE_ROWS or not (fmt.qtype == Q.Q4_K or fmt.gathered):
        return []
    grid = itertools.product([1, 2, 4, 8, 16], [1, 2, 4, 8], [1, 2, 4, 8], [1, 2])
    return [triton_gguf_wide.WideConfig(bn, blocks, warps, stages) for bn, blocks, warps, stages in grid
            if blocks * triton_gguf_wide.ELEMENTS <= triton.next_power_of_2(k)]


def sweep(fmt: BlockFormat, m: int, shape, tiny: bool, device, bandwidth, sm_count) -> list[dict]:
    rows = []
    for config in candidates(fmt, m, shape, sm_count):
        try:
            rows.append(measure(fmt, m, shape, tiny, device, bandwidth, config))
        except Exception as exc:  # e.g. a config that needs more shared memory than there is
            print(f"  skip {fmt.name} {_describe(config)}: {type(exc).__name__}", flush=True)
    best = min(rows, key=lambda row: row["us"])
    print(f"  {fmt.name} x {m} rows, N {shape[0]} x K {shape[1]}: best {best['us']:.2f} us with "
          f"{best['config']}", flush=True)
    return rows


def model_linears(rows: list[dict], names, layers: int) -> list[dict]:
    """Per format and row count, the ms a token of the projections ``names`` (the head once,
    the others ``layers`` times) at the chosen configs and at each shape's best."""
    totals = []
    swept = [r for r in rows if r.get("config") is not None]
    for fmt, m in dict.fromkeys((r["format"], r["rows"]) for r in swept):
        chosen = best = 0.0
        for name in names:
            times = [r for r in swept if (r["format"], r["rows"], r["projection"]) == (fmt, m, name)]
            count = 1 if name == "head" else layers
            chosen += count * next(r["us"] for r in times if r["config"] == "chosen")
            best += count * min(r["us"] for r in times)
        totals.append({"format": fmt, "rows": m, "chosen_ms": chosen / 1e3, "best_ms": best / 1e3})
    return totals


def _describe(config) -> str:
    return "(" + ", ".join(str(v) for v in attrs.astuple(config)) + ")"


def measure_16_bit(m: int, shape, tiny: bool, device, bandwidth) -> list[dict]:
    """torch's matmul, and up to 16 rows the bf16 split-K GEMV a decode step runs."""
    n, k = shape
    dtype = torch.float32 if tiny else torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=dtype)
    weights = common.weight_copies(lambda: torch.randn(n, k, device=device, dtype=dtype), n * k * 2, tiny)
    floor = n * k * 2 / bandwidth * 1e6 if bandwidth else None
    calls = {"torch": torch.nn.functional.linear}
    if m <= triton_gemv.MAX_M:
        calls["triton_gemv"] = triton_gemv.linear
    rows = []
    for name, call in calls.items():
        us = common.time_chain(weights, lambda w: call(x, w), tiny) * 1e6
        rows.append({"format": f"{name} {str(dtype).split('.')[-1]}", "rows": m, "n": n, "k": k,
                     "mb": n * k * 2 / 1e6, "us": us, "floor_us": floor,
                     "of_floor": floor / us if floor else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 32, 2048])
    parser.add_argument("--formats", nargs="+", default=[q.name for q in SUPPORTED] + [GATHERED])
    parser.add_argument("--projections", nargs="+", default=["down"],
                        choices=[*PROJECTIONS, "all"], help="the 1B shape's weights timed")
    parser.add_argument("--tiny", action="store_true", help="small shape (CPU: interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also time other configs (GPU)")
    parser.add_argument("--json", default="results/gguf_gemv.json")
    args = parser.parse_args()
    names = list(PROJECTIONS) if "all" in args.projections else args.projections
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    bandwidth = common.copy_bandwidth() if cuda else None
    sm_count = triton_attention.sm_count(torch.device(device)) if cuda else 132
    rows = []
    for m, name in itertools.product(args.rows, names):
        shape = TINY_SHAPE if args.tiny else PROJECTIONS[name]
        mine = measure_16_bit(m, shape, args.tiny, device, bandwidth)
        for fmt in map(block_format, args.formats):
            mine.append(measure(fmt, m, shape, args.tiny, device, bandwidth))
            if args.sweep:
                mine += sweep(fmt, m, shape, args.tiny, device, bandwidth, sm_count)
        for row in mine:  # the first row is torch's
            row.update(projection=name, vs_torch=mine[0]["us"] / row["us"])
        rows += mine
    layers = common.SHAPES["llama-3.2-1b"]["num_hidden_layers"]
    totals = model_linears(rows, names, layers) if args.sweep else []
    report(rows, totals, names, layers, bandwidth)
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "bandwidth": bandwidth, "tiny": args.tiny, "rows": rows,
                                  "model_linears": totals})


def report(rows: list[dict], totals: list[dict], names, layers: int, bandwidth) -> None:
    columns = ["format", "projection", "rows", "n", "k", "mb", "us", "floor_us", "of_floor", "vs_torch",
               "config"]
    print(common.table(rows, columns))
    band = f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no floor on the CPU"
    print(f"\n# GGUF linear kernels, {common.device_name()}, commit {common.git_commit()}, {band}; "
          "us per call; of_floor: floor / time; vs_torch: torch's time / time")
    if totals:
        print(common.table(totals, ["format", "rows", "chosen_ms", "best_ms"]))
        print(f"\n# the 1B shape's linears a token ({', '.join(names)}; the head once, the others "
              f"{layers} times) at the chosen configs and at each shape's best")


if __name__ == "__main__":
    main()
