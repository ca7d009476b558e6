"""Sweep split-K GEMV configs on the decode shapes of the benchmark models.

    python benchmarks/tune_gemv.py [--rows 1 8] [--json results/tune_gemv.json]

Each timing replays a CUDA graph of back-to-back launches over distinct weight copies
(more bytes than L2 holds), as in a decode step, with PDL as the engine launches it.
Prints, per shape, ``choose_config``'s time, the best config found, torch's, and the
bandwidth of each against the measured copy bandwidth.
"""

import argparse
import itertools

import torch

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


def configs(m: int):
    if m == 1:
        tiles = itertools.product([4, 8, 16], [256, 512, 1024], [4, 8], [1, 3])
    else:
        tiles = itertools.product([16, 32, 64], [64, 128, 256], [4], [3, 5])
    return [(bn, bk, warps, stages) for bn, bk, warps, stages in tiles]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough distinct copies that a chain streams from memory, not from L2."""
    count = min(80, max(CHAIN, -(-(150 << 20) // (n * k * 2))))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]


def time_chain(x: torch.Tensor, weights, launch) -> float:
    """Seconds per launch of one graph of launches over ``weights``."""
    launch(x, weights[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            launch(x, w)
    return common.gpu_time(graph.replay, iters=10) / len(weights)


def tune(m: int, n: int, k: int, sms: int) -> dict:
    weights = weight_copies(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    base = time_chain(x, weights, triton_gemv.linear)
    best, best_cfg = base, triton_gemv.choose_config(m, n, k, sms)
    splits_options = [1, 2, 4] if k >= 2048 else [1]
    for bn, bk, warps, stages in configs(m):
        for splits in splits_options:
            cfg = (bn, bk, splits, warps, stages)
            try:
                t = time_chain(x, weights, lambda x, w, c=cfg: triton_gemv.linear(x, w, config=c))
            except Exception as exc:  # a config Triton cannot compile (too much shared memory)
                print(f"  skip {cfg}: {type(exc).__name__}")
                continue
            if t < best:
                best, best_cfg = t, cfg
    torch_t = time_chain(x, weights, torch.nn.functional.linear)
    return {"m": m, "n": n, "k": k, "chosen_us": base * 1e6, "best_us": best * 1e6,
            "best_config": best_cfg, "torch_us": torch_t * 1e6, "mb": n * k * 2 / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(common.SHAPES))
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--json", default="results/tune_gemv.json")
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape in args.shapes:
        for name, (n, k) in decode_shapes(shape).items():
            for m in args.rows:
                row = {"shape": shape, "matrix": name, **tune(m, n, k, sms)}
                for key in ("chosen", "best", "torch"):
                    row[f"{key}_bw"] = row["mb"] * 1e6 / (row[f"{key}_us"] * 1e-6) / bandwidth
                rows.append(row)
                print(common.table([row], list(row)), flush=True)
                common.write_json(args.json, {"commit": common.git_commit(), "rows": rows,
                                              "bandwidth": bandwidth})
    print(f"\n# GEMV sweep, bf16, {common.device_name()}, commit {common.git_commit()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; *_bw is the fraction of it")
    print(common.table(rows, ["shape", "matrix", "m", "chosen_us", "best_us", "torch_us",
                              "chosen_bw", "best_bw", "torch_bw", "best_config"]))


if __name__ == "__main__":
    main()
