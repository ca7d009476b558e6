"""The GGUF linear kernels per block format, at the 1B shape's down projection (N 2048,
K 8192), against a bf16 torch matmul and bf16 split-K GEMV (fp32 under ``--tiny``) and the
bytes-read floor.

    python -m benchmarks.gguf_gemv [--rows 1 32 2048] [--json results/gguf_gemv.json]
    python -m benchmarks.gguf_gemv --tiny        (CPU: the Triton interpreter, small shape)
    python -m benchmarks.gguf_gemv --sweep --formats Q4_K --rows 1 32   (other configs too)

On a GPU each timing replays a CUDA graph of back-to-back calls over distinct weight copies
(more bytes than L2 holds), as a decode step streams its layers. One row goes through the
matrix-vector kernel, more through the tensor-core kernel (``triton_gguf_matmul.linear``);
2048 rows is a prefill's.
The floor is the weight's bytes over the measured device-to-device copy bandwidth. Weights
are random blocks with finite fp16 scales: the values do not change the time. ``--tiny``
only checks that the benchmark runs (interpreter times mean nothing). ``--sweep`` times the
kernel's other configs (``config`` column; the chosen one is ``chosen``) and prints each
format's best: about 20 compiles a format and row count.
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
from tokenspeed.backends.kernels import triton_gemv, triton_gguf_gemv, triton_gguf_matmul  # noqa: E402
from tokenspeed.backends.kernels.gguf_blocks import SUPPORTED, BlockFormat, block_format  # noqa: E402

SHAPE = (2048, 8192)  # llama-3.2-1b's down projection: N, K
TINY_SHAPE = (48, 512)
HALVES = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # byte offsets of fp16 fields


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
    return lambda w: triton_gguf_matmul.matmul(x, w, fmt, config=config)


def candidates(fmt: BlockFormat, m: int) -> list:
    """The configs ``--sweep`` times: split counts are not compiled in, so they are cheap."""
    if m == 1:
        tiles = itertools.product([1, 2, 4, 8], [512, 1024, 2048], [1, 2, 4], [1, 2, 4])
        return [triton_gguf_gemv.GemvConfig(bn, tile, splits, warps)
                for bn, tile, splits, warps in tiles]
    block_m = max(16, triton.next_power_of_2(m)) if m <= triton_gguf_matmul.SKINNY_M else 128
    if m <= triton_gguf_matmul.SKINNY_M:
        tiles = itertools.product([block_m], [16, 32, 64], [64, 128], [1, 2, 4, 8], [4], [2, 3])
    else:
        tiles = itertools.product([64, 128], [64, 128], [64], [1], [4, 8], [3, 4])
    return [triton_gguf_matmul.MatmulConfig(bm, bn, tile // fmt.group_size, splits, warps,
                                            stages)
            for bm, bn, tile, splits, warps, stages in tiles]


def sweep(fmt: BlockFormat, m: int, shape, tiny: bool, device, bandwidth) -> list[dict]:
    rows = []
    for config in candidates(fmt, m):
        try:
            rows.append(measure(fmt, m, shape, tiny, device, bandwidth, config))
        except Exception as exc:  # e.g. a config that needs more shared memory than there is
            print(f"  skip {fmt.name} {_describe(config)}: {type(exc).__name__}", flush=True)
    best = min(rows, key=lambda row: row["us"])
    print(f"  {fmt.name} x {m} rows: best {best['us']:.2f} us with {best['config']}", flush=True)
    return rows


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
    parser.add_argument("--formats", nargs="+", default=[q.name for q in SUPPORTED])
    parser.add_argument("--tiny", action="store_true", help="small shape (CPU: interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also time other configs (GPU)")
    parser.add_argument("--json", default="results/gguf_gemv.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, shape = ("cuda" if cuda else "cpu"), (TINY_SHAPE if args.tiny else SHAPE)
    bandwidth = common.copy_bandwidth() if cuda else None
    rows = []
    for m in args.rows:
        rows += measure_16_bit(m, shape, args.tiny, device, bandwidth)
        for name in args.formats:
            rows.append(measure(block_format(name), m, shape, args.tiny, device, bandwidth))
            if args.sweep:
                rows += sweep(block_format(name), m, shape, args.tiny, device, bandwidth)
    for row in rows:  # each batch's first row is torch's
        row["vs_torch"] = next(r["us"] for r in rows if r["rows"] == row["rows"]) / row["us"]
    columns = ["format", "rows", "n", "k", "mb", "us", "floor_us", "of_floor", "vs_torch", "config"]
    print(common.table(rows, columns))
    band = f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no floor on the CPU"
    print(f"\n# GGUF linear kernels, {common.device_name()}, commit {common.git_commit()}, {band}; "
          "us per call; of_floor: floor / time; vs_torch: torch's time / time")
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "bandwidth": bandwidth, "tiny": args.tiny, "rows": rows})


if __name__ == "__main__":
    main()
