"""Sweep split-K GEMV configs on the decode shapes of the benchmark models.

    python -m benchmarks.tune_gemv [--shapes ...] [--rows 1 8] [--matrices qkv o] [--json results/tune_gemv.json]

Each timing replays a CUDA graph of back-to-back launches over distinct weight copies
(more bytes than L2 holds), as in a decode step, with PDL as the engine launches it. Each
matrix is called as the step calls it: for one row the qkv and gate_up projections read a
normed input (``norm_linear`` with a residual) and the down projection a gated one (SiLU
of gate times up); for several rows every call is a plain ``linear``. Prints, per shape,
``choose_config``'s time, the best config found, torch's, and the bandwidth of each
against the measured copy bandwidth.
"""

import argparse
import itertools

import torch
import triton

from benchmarks import common
from tokenspeed.backends.kernels import triton_gemv

CHAIN = 12


def decode_shapes(shape: str) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of every matrix a decode step streams."""
    c = common.SHAPES[shape]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim", hidden // c["num_attention_heads"])
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * head_dim
    return {"qkv": (qkv, hidden), "o": (hidden, c["num_attention_heads"] * head_dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter),
            "lm_head": (c["vocab_size"], hidden)}


def fused_input(name: str, m: int) -> str:
    """How a decode step feeds the matrix ``name`` (see ``dispatch``): fused for one row."""
    if m > 1:
        return "plain"
    return {"qkv": "normed", "gate_up": "normed", "down": "gated"}.get(name, "plain")


def configs(m: int, k: int, kind: str):
    if kind == "normed":  # one tile per row: only the column blocks and warps vary
        tiles = itertools.product([2, 4, 8, 16], [triton.next_power_of_2(k)], [1], [2, 4, 8],
                                  [1])
    elif m == 1:
        tiles = itertools.product([2, 4, 8], [512, 1024, 2048], [1, 2, 4], [4, 8], [3])
    else:
        tiles = itertools.product([16, 32, 64], [128, 256], [1, 2, 4], [4], [3, 5])
    return [(bn, bk, splits, warps, stages) for bn, bk, splits, warps, stages in tiles
            if bk <= max(triton.next_power_of_2(k), 64)]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough distinct copies that a chain streams from memory, not from L2."""
    count = min(80, max(CHAIN, -(-(150 << 20) // (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]


def launcher(m: int, k: int, kind: str):
    """``config -> (weight -> output)``, the GEMV called as the step calls it."""
    dev = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, 2 * k if kind == "gated" else k, **dev)
    residual, norm_weight = torch.randn(m, k, **dev), torch.randn(k, **dev)
    if kind == "normed":
        return lambda c: lambda w: triton_gemv.norm_linear(x, residual, norm_weight, 1e-6, w,
                                                           config=c)
    return lambda c: lambda w: triton_gemv.linear(x, w, config=c, gated=kind == "gated")


def tune(name: str, m: int, n: int, k: int, sms: int) -> dict:
    kind = fused_input(name, m)
    weights, launch = weight_copies(n, k), launcher(m, k, kind)
    base = common.graph_time_per_call(weights, launch(None))
    best = base, triton_gemv.choose_config(m, n, k, sms, normed=kind == "normed")
    for cfg in configs(m, k, kind):
        try:
            best = min(best, (common.graph_time_per_call(weights, launch(cfg)), cfg))
        except Exception as exc:  # a config Triton cannot compile (too much shared memory)
            print(f"  skip {cfg}: {type(exc).__name__}")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    torch_t = common.graph_time_per_call(weights, lambda w: torch.nn.functional.linear(x, w))
    return {"m": m, "n": n, "k": k, "input": kind, "chosen_us": base * 1e6,
            "best_us": best[0] * 1e6, "best_config": best[1], "torch_us": torch_t * 1e6,
            "mb": n * k * 2 / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(common.SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--matrices", nargs="+", default=None,
                        help="only these of each shape's matrices (qkv o gate_up down lm_head)")
    parser.add_argument("--json", default="results/tune_gemv.json")
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in args.shapes:
        for name, (n, k) in decode_shapes(shape).items():
            if args.matrices is not None and name not in args.matrices:
                continue
            for m in args.rows:
                row = {"shape": shape, "matrix": name, **tune(name, m, n, k, sms)}
                for key in ("chosen", "best", "torch"):
                    row[f"{key}_bw"] = row["mb"] * 1e6 / (row[f"{key}_us"] * 1e-6) / bandwidth
                rows.append(row)
                print(common.table([row], list(row)), flush=True)
                common.write_json(args.json, {"commit": common.git_commit(), "rows": rows,
                                              "bandwidth": bandwidth})
    print(f"\n# GEMV sweep, bf16, {common.device_name()}, commit {common.git_commit()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; *_bw is the fraction of it")
    print(common.table(rows, ["shape", "matrix", "m", "input", "chosen_us", "best_us", "torch_us",
                              "chosen_bw", "best_bw", "torch_bw", "best_config"]))


if __name__ == "__main__":
    main()
