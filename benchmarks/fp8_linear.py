"""FP8 linear kernels against bf16 on the Llama-3.2-1B projections: the decode GEMV
(``triton_fp8_gemv``) at 1, 8 and 16 rows and the prefill matmul (``fp8_matmul``:
``torch._scaled_mm`` for per-channel scales, ``triton_fp8_block_matmul`` for 128 x 128
blocks) at 2048 rows, beside torch's bf16 ``linear`` and (up to 16 rows) the bf16
``triton_gemv``, with the weight's GB/s and the bytes-read floor.

    python -m benchmarks.fp8_linear [--rows 1 8 16 2048] [--json results/fp8_linear.json]
    python -m benchmarks.fp8_linear --tiny        (CPU: the Triton interpreter, small shapes)
    python -m benchmarks.fp8_linear --sweep --projections down --rows 1 [--layouts channel]
                                    (other configs too; --layouts: which scales)

On a GPU each timing replays a CUDA graph of back-to-back calls over distinct weight
copies (more bytes than L2 holds), as a decode step streams its layers. The down
projection's kernels read the MLP's gate_up rows (``gated``: silu(gate) * up computed as
x is read, or as it is quantized; torch's row multiplies it precomputed); the FP8 matmul
rows include quantizing the activations (``quant_us`` is that kernel alone). The floor is the
weight's bytes over the measured device-to-device copy bandwidth; ``tflops`` is the
product's rate. ``--tiny`` only checks that the benchmark runs (interpreter times mean
nothing). ``--sweep`` also times the kernels' other configs (``config`` column; the
chosen one is ``chosen``) and prints each case's best.
"""

import argparse
import itertools
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs  # noqa: E402

from benchmarks import common  # noqa: E402
from tokenspeed.backends.kernels import fp8_matmul, fp8_weights, triton_fp8_block_matmul  # noqa: E402
from tokenspeed.backends.kernels import triton_fp8_gemv, triton_fp8_quantize, triton_gemv  # noqa: E402

PROJECTIONS = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048),
               "down": (2048, 8192)}  # llama-3.2-1b: N, K
TINY = 64  # --tiny divides each dimension by this (every one stays a multiple of 16)
LAYOUTS = ("channel", "block")


@attrs.frozen
class Case:
    """One projection at one row count, and where it runs."""
    projection: str
    n: int
    k: int
    rows: int
    tiny: bool
    device: str

    @property
    def gated(self) -> bool:
        return self.projection == "down"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.tiny else torch.bfloat16

    def x(self) -> torch.Tensor:
        return torch.randn(self.rows, (2 if self.gated else 1) * self.k, device=self.device,
                           dtype=self.dtype)


def fp8_weight(case: Case, layout: str):
    """(weight, scale): random FP8 values with modest scales (values do not change times)."""
    weight = (torch.randn(case.n, case.k, device=case.device) * 32).to(fp8_weights.FP8)
    shape = (case.n,) if layout == "channel" else fp8_weights.block_scale_shape(case.n, case.k)
    return weight, torch.rand(shape, device=case.device) * 0.01 + 0.001


def row(case: Case, kernel: str, nbytes: int, seconds: float, bandwidth, **extra) -> dict:
    floor = nbytes / bandwidth * 1e6 if bandwidth else None
    us = seconds * 1e6
    return {"projection": case.projection, "kernel": kernel, "rows": case.rows, "n": case.n,
            "k": case.k, "mb": nbytes / 1e6, "us": us, "gbps": nbytes / seconds / 1e9,
            "floor_us": floor, "of_floor": floor / us if floor else None,
            "tflops": 2 * case.rows * case.n * case.k / seconds / 1e12, **extra}


def measure_16_bit(case: Case, bandwidth) -> list[dict]:
    """torch's linear, and up to 16 rows the bf16 split-K GEMV a decode step runs."""
    nbytes = case.n * case.k * 2
    weights = common.weight_copies(lambda: torch.randn(case.n, case.k, device=case.device, dtype=case.dtype),
                     nbytes, case.tiny)
    x = case.x()
    plain = reference_input(x, case)
    calls = {"torch": lambda w: torch.nn.functional.linear(plain, w)}
    if case.rows <= triton_gemv.MAX_M:
        calls["triton_gemv"] = lambda w: triton_gemv.linear(x, w, gated=case.gated)
    name = str(case.dtype).split(".")[-1]
    return [row(case, f"{kernel} {name}", nbytes, common.time_chain(weights, call, case.tiny), bandwidth)
            for kernel, call in calls.items()]


def reference_input(x: torch.Tensor, case: Case) -> torch.Tensor:
    """What torch's linear multiplies: the gated rows' silu(gate) * up, computed once."""
    if not case.gated:
        return x
    gate, up = x.chunk(2, dim=1)
    return torch.nn.functional.silu(gate) * up


def fp8_call(case: Case, x: torch.Tensor, config=None):
    """(weight, scale) -> output, as the engine calls the FP8 kernels."""
    if case.rows <= triton_fp8_gemv.MAX_M:
        return lambda ws: triton_fp8_gemv.linear(x, *ws, gated=case.gated, config=config)
    if config is not None:
        return lambda ws: triton_fp8_block_matmul.linear(x, *ws, config=config, gated=case.gated)
    return lambda ws: fp8_matmul.linear(x, *ws, gated=case.gated)


def measure_fp8(case: Case, layout: str, bandwidth, config=None) -> dict:
    nbytes = case.n * case.k
    weights = common.weight_copies(lambda: fp8_weight(case, layout), nbytes, case.tiny)
    x = case.x()
    seconds = common.time_chain(weights, fp8_call(case, x, config), case.tiny)
    extra = {"config": "chosen" if config is None else describe(config)}
    if case.rows > triton_fp8_gemv.MAX_M:
        group = fp8_weights.BLOCK if layout == "block" else None
        quant = common.time_chain([x], lambda a: triton_fp8_quantize.quantize_activations(
            a, group, case.gated), case.tiny)
        extra["quant_us"] = quant * 1e6
    return row(case, f"fp8 {layout}", nbytes, seconds, bandwidth, **extra)


def describe(config) -> str:
    return "(" + ", ".join(str(v) for v in attrs.astuple(config)) + ")"


def candidates(case: Case, layout: str) -> list:
    """The configs ``--sweep`` times (split counts are not compiled in: cheap)."""
    if case.rows == 1:
        grid = itertools.product([2, 4, 8, 16], [1024, 2048, 4096], [1, 2, 4], [4, 8], [3])
        return [triton_fp8_gemv.GemvConfig(*c) for c in grid]
    if case.rows <= triton_fp8_gemv.MAX_M:
        grid = itertools.product([32, 64, 128], [64, 128], [1, 2, 4, 8], [4], [3, 5])
        return [triton_fp8_gemv.GemvConfig(*c) for c in grid]
    if layout == "channel":
        return []  # torch._scaled_mm picks its own
    grid = itertools.product([64, 128, 256], [64, 128], [1], [4, 8], [3, 4])
    return [triton_fp8_block_matmul.MatmulConfig(*c) for c in grid]


def sweep(case: Case, layout: str, bandwidth) -> list[dict]:
    rows = []
    for config in candidates(case, layout):
        try:
            rows.append(measure_fp8(case, layout, bandwidth, config))
        except Exception as exc:  # e.g. a config that needs more shared memory than there is
            print(f"  skip {layout} {describe(config)}: {type(exc).__name__}", flush=True)
    if rows:
        best = min(rows, key=lambda r: r["us"])
        print(f"  {case.projection} {layout} x {case.rows} rows: best {best['us']:.2f} us "
              f"with {best['config']}", flush=True)
    return rows


def measure(case: Case, bandwidth, sweeping: bool, layouts=LAYOUTS) -> list[dict]:
    rows = measure_16_bit(case, bandwidth)
    for layout in layouts:
        rows.append(measure_fp8(case, layout, bandwidth))
        if sweeping:
            rows += sweep(case, layout, bandwidth)
    for r in rows:  # the case's first row is torch's
        r["vs_torch"] = rows[0]["us"] / r["us"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8, 16, 2048])
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS),
                        choices=list(PROJECTIONS))
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU: interpreter)")
    parser.add_argument("--sweep", action="store_true", help="also time other configs (GPU)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS,
                        help="FP8 scales: per output channel, per 128 x 128 block")
    parser.add_argument("--json", default="results/fp8_linear.json")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    bandwidth = common.copy_bandwidth() if cuda else None
    rows = []
    for m in args.rows:
        for name in args.projections:
            n, k = PROJECTIONS[name]
            if args.tiny:
                n, k = n // TINY, k // TINY
            rows += measure(Case(name, n, k, m, args.tiny, device), bandwidth, args.sweep, args.layouts)
    columns = ["projection", "kernel", "rows", "n", "k", "mb", "us", "gbps", "floor_us",
               "of_floor", "tflops", "quant_us", "vs_torch", "config"]
    print(common.table(rows, columns))
    band = f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth else "no floor on the CPU"
    print(f"\n# FP8 linear kernels, {common.device_name()}, commit {common.git_commit()}, {band}; "
          "us per call; of_floor: floor / time; vs_torch: torch's time / time")
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "bandwidth": bandwidth, "tiny": args.tiny, "rows": rows})


if __name__ == "__main__":
    main()
