"""The fused MoE kernel (``triton_moe``) at the expert shapes of Qwen3-30B-A3B (128 experts,
8 a token, hidden 2048, expert width 768) and DeepSeek-V2-Lite (64 experts, 6 a token,
width 1408), over 1 to 2048 tokens, against the floor of the bytes it must read.

    python -m benchmarks.moe_kernel [--tokens 1 8 32 128 2048] [--kernel auto|grouped|by_pairs]
                                    [--json results/moe_kernel.json]
    python -m benchmarks.moe_kernel --tiny        (CPU: the Triton interpreter, small shapes)

Each timing replays a CUDA graph of the op over distinct copies of the layer's experts (more
bytes than L2 holds), as a decode step streams its layers; the routing is a softmax top-k
of random logits, drawn once. The floor is the bytes of the experts that routing touches
(each once) over the measured device-to-device copy bandwidth; ``tflops`` counts the
products of the pairs alone. ``--kernel`` times one path at every size (``auto``: the op's
choice, by pair up to ``triton_moe_pairs.MAX_TOKENS`` tokens). ``--tiny`` only checks that
the benchmark runs.
"""

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import attrs  # noqa: E402

from benchmarks import common  # noqa: E402
from tokenspeed.backends.kernels import triton_moe, triton_moe_pairs  # noqa: E402

def expert_shape(name: str) -> tuple[int, int, int, int]:
    """(experts, k, hidden, expert width) of one of ``common.SHAPES``' mixtures."""
    c = common.SHAPES[name]
    return c.get("num_experts") or c["n_routed_experts"], c["num_experts_per_tok"], c["hidden_size"], \
        c["moe_intermediate_size"]


SHAPES = {name: expert_shape(name) for name in ("qwen3-30b-a3b", "deepseek-v2-lite")}  # E, k, H, I
TINY = 32  # --tiny divides the widths by this and keeps 8 experts
KERNELS = {"auto": triton_moe.moe, "grouped": triton_moe.moe_grouped, "by_pairs": triton_moe_pairs.moe_by_pairs}


@attrs.frozen
class Case:
    shape: str
    tokens: int
    tiny: bool
    kernel: str = "auto"

    @property
    def dims(self) -> tuple[int, int, int, int]:
        experts, k, hidden, inter = SHAPES[self.shape]
        return (8, min(k, 4), hidden // TINY, inter // TINY) if self.tiny else (experts, k, hidden, inter)

    @property
    def device(self) -> str:
        return "cpu" if self.tiny else "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.tiny else torch.bfloat16


def experts(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    e, _, hidden, inter = case.dims
    w13 = torch.randn(e, 2 * inter, hidden, device=case.device, dtype=case.dtype) / hidden ** 0.5
    return w13, torch.randn(e, hidden, inter, device=case.device, dtype=case.dtype) / inter ** 0.5


def routing(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e, k, hidden, _ = case.dims
    gen = torch.Generator(device=case.device).manual_seed(case.tokens)
    x = torch.randn(case.tokens, hidden, device=case.device, dtype=case.dtype, generator=gen)
    weights, ids = torch.randn(case.tokens, e, device=case.device, generator=gen).softmax(-1).topk(k)
    return x, weights, ids


def measure(case: Case, bandwidth: float | None) -> dict:
    e, k, hidden, inter = case.dims
    x, weights, ids = routing(case)
    per_expert = 3 * inter * hidden * torch.finfo(case.dtype).bits // 8
    copies = common.weight_copies(lambda: experts(case), e * per_expert, case.tiny)
    op = KERNELS[case.kernel]
    seconds = common.time_chain(copies, lambda w: op(x, w[0], w[1], weights, ids), case.tiny)
    touched = ids.unique().numel() * per_expert
    floor = touched / bandwidth * 1e6 if bandwidth else None
    return {"shape": case.shape, "kernel": case.kernel, "tokens": case.tokens, "experts_touched": ids.unique().numel(),
            "mb": touched / 1e6, "us": seconds * 1e6, "floor_us": floor,
            "of_floor": floor / (seconds * 1e6) if floor else None,
            "tflops": 2 * 3 * case.tokens * k * hidden * inter / seconds / 1e12}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 32, 128, 2048])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tiny", action="store_true", help="small shapes (CPU: interpreter)")
    parser.add_argument("--kernel", default="auto", choices=list(KERNELS))
    parser.add_argument("--json", default="results/moe_kernel.json")
    args = parser.parse_args()
    bandwidth = None if args.tiny else common.copy_bandwidth()
    rows = [measure(Case(shape, tokens, args.tiny, args.kernel), bandwidth)
            for shape in args.shapes for tokens in args.tokens]
    print(common.table(rows, ["shape", "kernel", "tokens", "experts_touched", "mb", "us", "floor_us", "of_floor",
                              "tflops"]))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "bandwidth_gbps": bandwidth / 1e9 if bandwidth else None, "rows": rows})


if __name__ == "__main__":
    main()
