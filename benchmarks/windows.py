"""Sliding windows: KV pages, how many full-length sequences fit at once, and decode speed
of a Mistral-style shape (every layer windowed) and a mixed one (Qwen2-style
``layer_types``, every other layer windowed: two cache groups) against the same shape
without windows.

    python -m benchmarks.windows [--shape llama-3.2-1b] [--window 4096] [--context 32768]
                                 [--batches 1 32]

Per engine: the pool's KV pages (sized by the default ``gpu_memory_utilization``: a probe
pool, captures, then the real pool; no larger than ``max_num_seqs`` sequences need), the
pages one sequence of ``--context`` tokens holds at once (a windowed one its window's and
a prefill chunk's, an unwindowed one its whole context), how many such sequences fit in
``--kv-gib`` of KV memory, startup seconds (the probe and the rebind included; ``rebind_s``: measuring,
binding the pool and capturing again), and time per output token at each batch after prompts longer
than the window, against the memory floor: the weights and the keys and values a step
reads (the window's, not the whole context's). Random weights (speed only); ``--shape
tiny`` runs on the CPU as a trial.
"""

import argparse
import time

import torch

import tokenspeed as ts
from benchmarks import common
from tokenspeed.models.random import TINY_LLAMA, random_model


def shape_config(shape: str, window: int | None, mixed: bool = False) -> dict:
    config = dict(TINY_LLAMA if shape == "tiny" else common.SHAPES[shape])
    if window is None:
        return config
    if mixed:
        types = ["sliding_attention" if i % 2 else "full_attention" for i in range(config["num_hidden_layers"])]
        return {**config, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
                "sliding_window": window, "layer_types": types}
    return {**config, "architectures": ["MistralForCausalLM"], "sliding_window": window}


def tpot(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Seconds per output token of ``batch`` prompts of ``prompt_len`` tokens."""
    prompts = [[100 + (7 * i + j) % 900 for j in range(prompt_len)] for i in range(batch)]
    run = lambda n: llm.generate(prompts, ts.SamplingParams(  # noqa: E731
        temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    run(2)
    return (common.median_time(lambda: run(new_tokens + 1), 3) - common.median_time(lambda: run(1), 3)) / new_tokens


def bench(args, name: str, window: int | None, bandwidth: float | None, mixed: bool = False) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(shape_config(args.shape, window, mixed), dtype=dtype, device=device)
    start = time.perf_counter()
    llm = ts.LLM(model, device=device, max_num_seqs=max(args.batches), max_model_len=args.context,
                 enable_prefix_caching=False)
    startup = time.perf_counter() - start
    pool = llm.compiled.pool
    sequence_bytes = pool.pages_per_sequence * pool.page_bytes
    rows = []
    for batch in args.batches:
        with torch.inference_mode():
            seconds = tpot(llm, batch, args.prompt_len, args.new_tokens)
        context = args.prompt_len + args.new_tokens // 2
        windowed = sum(map(bool, model.config.layer_windows)) / model.config.num_layers
        read = windowed * min(context, window or context) + (1 - windowed) * context   # per layer, on average
        row = {"engine": name, "window": window or 0, "cache_groups": len(model.config.cache_groups),
               "kv_pages": pool.num_pages - 1,
               "kv_gib": pool.num_pages * pool.page_bytes / 2**30, "pages_per_sequence": pool.pages_per_sequence,
               "sequences_in_budget": int(args.kv_gib * 2**30 // sequence_bytes), "startup_s": startup,
               "rebind_s": pool.rebind_seconds, "non_kv_gib": pool.non_kv_bytes / 2**30,
               "batch": batch, "ms_per_token": seconds * 1e3}
        if bandwidth:
            floor = (common.weight_bytes(model) + common.kv_bytes(model.config, batch, int(read))) / bandwidth
            row.update(floor_ms=floor * 1e3, x_floor=seconds / floor)
        rows.append(row)
        print(common.table([row], list(row)), flush=True)
    print(llm.compiled.pool.as_text(), flush=True)
    del llm, model           # the next engine's pool is sized by what is left
    common.release_memory()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-3.2-1b", help="a benchmark shape, or tiny (CPU trials)")
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--context", type=int, default=32768, help="max_model_len of both engines")
    parser.add_argument("--prompt-len", type=int, default=8192, help="longer than the window")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--kv-gib", type=float, default=80.0,
                        help="a KV budget: how many sequences of --context tokens each engine fits in it")
    parser.add_argument("--json", default="results/windows.json")
    args = parser.parse_args()
    bandwidth = common.copy_bandwidth() if torch.cuda.is_available() else None
    rows = bench(args, "windowed", args.window, bandwidth) + \
        bench(args, "mixed", args.window, bandwidth, mixed=True) + bench(args, "full", None, bandwidth)
    print(f"\n# sliding windows, {args.shape}, window {args.window}, context {args.context}, "
          f"prompt {args.prompt_len}, {common.device_name()}, commit {common.git_commit()}")
    print(common.table(rows, list(rows[0])))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "bandwidth": bandwidth, "rows": rows})


if __name__ == "__main__":
    main()
