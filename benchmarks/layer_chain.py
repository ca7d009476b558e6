"""Time a batch-1 decode step's layer kernels in the order the step runs them, one
matrix's GEMV config changed at a time.

    python -m benchmarks.layer_chain [--shapes ...] [--json results/layer_chain.json]

A chain of one GEMV repeated (``tune_gemv.py``) misses how neighbours overlap under PDL,
where each kernel's early reads run while the one before it finishes. Here a CUDA graph
replays every layer as the step runs it: normed qkv GEMV, rotary and decode attention
(and its split merge) over 512 cached keys, o, normed gate_up, gated down; each layer has
its own weights and cache. The peer is the same chain with cuBLAS projections (and the
norm and activation kernels they then need); the floor is the chain's weight and KV bytes
over the measured copy bandwidth.
"""

import argparse

import torch
import triton

from benchmarks import common
from benchmarks.tune_gemv import decode_shapes, fused_input
from tokenspeed.backends.kernels import triton_decode, triton_fused, triton_gemv
from tokenspeed.ir.rope import cos_sin_table

CONTEXT = 513   # the prompt of decode.py and the row's own key
PAGE = 16
MATRICES = ("qkv", "o", "gate_up", "down")


def build(shape: str) -> dict:
    c, dims = common.SHAPES[shape], decode_shapes(shape)
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim", c["hidden_size"] // heads)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    layers = [{name: torch.randn(dims[name], **bf) / 64 for name in MATRICES} |
              {"norm1": torch.ones(c["hidden_size"], **bf), "norm2": torch.ones(c["hidden_size"], **bf)}
              for _ in range(c["num_hidden_layers"])]
    pages = -(-CONTEXT // PAGE)
    table = torch.zeros(1, 4096 // PAGE, dtype=torch.int32, device="cuda")
    table[0, :pages] = torch.arange(1, pages + 1)
    position = torch.tensor([CONTEXT - 1], device="cuda")
    return dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, layers=layers, table=table,
                position=position, rows=torch.zeros(1, dtype=torch.int64, device="cuda"),
                slot=table[0, position // PAGE].long() * PAGE + position % PAGE,
                kv=torch.randn(len(layers), 2, (pages + 1) * PAGE, kv_heads, head_dim, **bf),
                cos_sin=cos_sin_table(1e-4 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim),
                                      torch.arange(4096, device="cuda")),
                x=torch.randn(1, c["hidden_size"], **bf), residual=torch.randn(1, c["hidden_size"], **bf))


def projections(configs: dict, cublas: bool):
    """``(name, x, residual, layer) -> (out, residual)`` as the step calls each matrix."""
    def project(name, x, residual, layer):
        w, kind = layer[name], fused_input(name, 1)
        norm = layer["norm1" if name == "qkv" else "norm2"]
        if not cublas and kind == "normed":
            return triton_gemv.norm_linear(x, residual, norm, 1e-6, w, config=configs.get(name))
        if not cublas:
            return triton_gemv.linear(x, w, config=configs.get(name), gated=kind == "gated"), residual
        if kind == "normed":
            x, residual = triton_fused.add_rms_norm(x, residual, norm, 1e-6)
        if kind == "gated":
            x = triton_fused.silu_and_mul(x)
        return torch.nn.functional.linear(x, w), residual
    return project


def step(s: dict, project) -> torch.Tensor:
    x, residual = s["x"], s["residual"]
    heads, kv_heads, head_dim = s["heads"], s["kv_heads"], s["head_dim"]
    for index, layer in enumerate(s["layers"]):
        qkv, residual = project("qkv", x, residual, layer)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
        attn = triton_decode.rope_decode_attention(
            q.view(1, heads, head_dim), k.view(1, kv_heads, head_dim), v.view(1, kv_heads, head_dim),
            s["cos_sin"], s["position"], s["kv"], index, s["slot"], s["table"], s["rows"],
            head_dim ** -0.5, PAGE)
        o, _ = project("o", attn.view(1, -1), None, layer)
        gate_up, residual = project("gate_up", o, residual, layer)
        x, _ = project("down", gate_up, None, layer)
    return x


def replay_us(fn) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return min(common.gpu_time(graph.replay, iters=200, warmup=10) for _ in range(3)) * 1e6


def candidates(name: str, k: int, chosen: tuple) -> list[tuple]:
    """Configs around the chosen one (column block, K tile and splits, warps by tile size),
    each as it launches (see ``split_k``), none twice and not the chosen one."""
    if fused_input(name, 1) == "normed":
        tile = triton.next_power_of_2(k)
        configs = [(bn, tile, 1, warps, 1) for bn in (4, 8, 16) for warps in (4, 8)]
    else:
        configs = [(bn, bk, splits, 8 if bn * bk >= 8192 else 4, 3) for bn in (2, 4, 8)
                   for bk in (1024, 2048) for splits in (1, 4)]
    launched = [as_launched(c, k) for c in configs]
    return [c for i, c in enumerate(launched) if c not in launched[:i] and c != as_launched(chosen, k)]


def as_launched(config: tuple, k: int) -> tuple:
    block_n, block_k, splits, warps, stages = config
    return block_n, block_k, triton_gemv.split_k(k, block_k, splits)[1], warps, stages


def sweep(shape: str, bandwidth: float) -> list[dict]:
    s, dims = build(shape), decode_shapes(shape)
    nbytes = sum(w.numel() * 2 for layer in s["layers"] for n, w in layer.items() if n in MATRICES)
    nbytes += s["kv"][:, :, :CONTEXT].numel() * 2
    floor_us = nbytes / bandwidth * 1e6
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = [{"shape": shape, "variant": variant, "us": replay_us(lambda: step(s, projections({}, cublas)))}
            for variant, cublas in (("chosen configs", False), ("cuBLAS projections", True))]
    for name in MATRICES:
        n, k = dims[name]
        chosen = triton_gemv.choose_config(1, n, k, sms, normed=fused_input(name, 1) == "normed")
        for config in candidates(name, k, chosen):
            try:
                us = replay_us(lambda: step(s, projections({name: config}, False)))
            except Exception as exc:  # a config Triton cannot compile (too much shared memory)
                print(f"  skip {name} {config}: {type(exc).__name__}")
                continue
            rows.append({"shape": shape, "variant": f"{name} {config}", "us": us})
        print(f"{shape}: {name} swept (chosen {chosen})", flush=True)
    for row in rows:
        row.update(us_per_layer=row["us"] / len(s["layers"]), x_floor=row["us"] / floor_us,
                   vs_chosen=row["us"] / rows[0]["us"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(common.DENSE_SHAPES))
    parser.add_argument("--json", default="results/layer_chain.json")
    parser.add_argument("--top", type=int, default=8, help="variants printed per shape")
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth()
    rows, shown = [], []
    for shape in args.shapes:
        found = sweep(shape, bandwidth)
        rows += found
        shown += found[:2] + sorted(found[2:], key=lambda r: r["us"])[:args.top]
        common.write_json(args.json, {"commit": common.git_commit(), "bandwidth": bandwidth, "rows": rows})
    print(f"\n# decode layer chain, batch 1, bf16, {common.device_name()}, commit "
          f"{common.git_commit()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s; fastest variants")
    print(common.table(shown, ["shape", "variant", "us", "us_per_layer", "x_floor", "vs_chosen"]))


if __name__ == "__main__":
    main()
