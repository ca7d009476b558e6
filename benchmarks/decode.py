"""Decode time per output token against Hugging Face peers and the memory floor.

    python -m benchmarks.decode [--shapes qwen2.5-0.5b llama-3.2-1b] [--batches 1 8 32]
    python -m benchmarks.decode --speculative 4 --batches 1 16      (speculative decoding rows)
    python -m benchmarks.decode --no-peers --skip-kernels triton_decode._combine_kernel

``--skip-kernels``: the named Triton kernels launch nothing (``common.kernels_skipped``): the
tokens are wrong, and the time bounds what fusing those kernels away could gain.

Peers measured in the same run: Hugging Face eager ``generate``; ``generate`` with a static
cache and torch.compile(mode="reduce-overhead") (``hf_generate_compile_ms``); and, as its best
user would time it, a plain greedy loop over a ``StaticCache`` with the one-token forward
compiled in that mode (``hf_compile_ms``, the speedup's peer). Floor: weight bytes + KV bytes read per step over
the measured device-to-device copy bandwidth. ``ours_ms`` is the default engine (overlapped
decoding); ``ours_sync_ms`` reads every step's tokens before preparing the next.
"""

import argparse
import statistics
import time

import torch

import tokenspeed as ts
from benchmarks import common

PROMPT = 512


def hf_tpot(model, batch: int, new_tokens: int, static: bool) -> float:
    ids = torch.randint(100, 1000, (batch, PROMPT), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    if static:
        from transformers import CompileConfig
        kw.update(cache_implementation="static",
                  compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))
    run = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)  # noqa: E731
    run(new_tokens)  # warm-up (compiles when static)
    return (common.median_time(lambda: run(new_tokens + 1), 3) -
            common.median_time(lambda: run(1), 3)) / new_tokens


def hf_loop_tpot(model, batch: int, new_tokens: int) -> float:
    return common.hf_static_loop_tpot(model, torch.randint(100, 1000, (batch, PROMPT), device="cuda"), new_tokens)


def our_tpot(llm, batch: int, new_tokens: int) -> float:
    prompts = [[100 + (7 * i + j) % 900 for j in range(PROMPT)] for i in range(batch)]
    run = lambda n: llm.generate(prompts, ts.SamplingParams(  # noqa: E731
        temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    run(4)
    return (common.median_time(lambda: run(new_tokens + 1), 3) -
            common.median_time(lambda: run(1), 3)) / new_tokens


def bench_shape(shape: str, batches, new_tokens: int, bandwidth: float, peers: bool, done: list,
                json_path: str, skipped: tuple = ()) -> list[dict]:
    hf = common.hf_model(shape)
    ours = common.our_model(shape, hf)
    start = time.perf_counter()
    kw = dict(device="cuda", max_num_seqs=max(batches), max_model_len=4096, max_num_batched_tokens=2048,
              num_kv_pages=8192, enable_prefix_caching=False)  # the repeated prompts would hit
    llm = ts.LLM(ours, **kw)
    startup = time.perf_counter() - start
    synchronous = ts.LLM(ours, overlap=False, **kw)
    rows = []
    for batch in batches:
        with torch.inference_mode():
            tpot = our_tpot(llm, batch, new_tokens)
            tpot_sync = our_tpot(synchronous, batch, new_tokens)
            kernels = llm.compiled.kernels_per_step(batch)
        floor = (common.weight_bytes(ours) + common.kv_bytes(ours.config, batch, PROMPT + new_tokens // 2)) / bandwidth
        row = {"shape": shape, "batch": batch, "ours_ms": tpot * 1e3,
               "ours_sync_ms": tpot_sync * 1e3, "floor_ms": floor * 1e3,
               "x_floor": tpot / floor, "kernels_per_step": kernels,
               "startup_s": startup, "graph_mem_mb": llm.compiled.startup.graph_memory_bytes / 2**20}
        if skipped:
            row["skipped_kernels"] = " ".join(skipped)
        if peers:
            with torch.inference_mode():
                row["hf_eager_ms"] = hf_tpot(hf, batch, new_tokens, static=False) * 1e3
                row["hf_generate_compile_ms"] = hf_tpot(hf, batch, new_tokens, static=True) * 1e3
                row["hf_compile_ms"] = hf_loop_tpot(hf, batch, new_tokens) * 1e3
            row["x_vs_compile"] = row["hf_compile_ms"] / row["ours_ms"]
        rows.append(row)
        done.append(row)
        common.write_json(json_path, {"commit": common.git_commit(), "device": common.device_name(),
                                      "bandwidth": bandwidth, "rows": done})
        print(common.table([row], list(row)), flush=True)
    del llm, synchronous, hf, ours
    common.release_memory()
    return rows


CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        if item.quantity <= 0:
            continue
        total += item.price * item.quantity
    return total * (1 + tax_rate)


def average_price(items):
    prices = [item.price for item in items if item.quantity > 0]
    if not prices:
        return 0.0
    return sum(prices) / len(prices)
"""
TEXT = ("The old lighthouse stood at the edge of the cliff, its white paint peeling in the salty wind. "
        "Every evening the keeper climbed the spiral stairs, lit the great lamp, and watched the ships "
        "pass safely through the narrow channel below. In winter the storms were fierce, but the light "
        "never failed.")
REPETITIVE = ["Add a docstring to each function in this code and output the whole code:\n\n" + CODE,
              "Fix the spelling mistakes in this paragraph and output the corrected paragraph:\n\n" +
              TEXT.replace("lighthouse", "lighthuose").replace("narrow", "narow"),
              "Repeat this paragraph exactly:\n\n" + TEXT,
              "Rewrite this paragraph in the past tense:\n\n" + TEXT,
              'Convert this JSON to YAML:\n{"name": "server", "port": 8080, "debug": true, "hosts": '
              '["alpha", "beta", "gamma"], "database": {"user": "admin", "password": "secret", "timeout": 30}}']
FREE_FORM = ["Write a short story about a lighthouse keeper.", "Explain how rain forms.",
             "Describe your ideal weekend in detail.", "What are the benefits of learning a second language?",
             "Give me three ideas for a birthday party."]


def speculative_rows(num_tokens: int, batches, new_tokens: int, model: str | None) -> list[dict]:
    """The default model (bf16 on a GPU) with and without n-gram speculation, on prompts
    that ask to copy or edit a given text or code and on free-form ones, each answer to its
    end (greedy: both engines give the same tokens): time per output token and accept length."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else None
    kw = dict(model=model, device=device, dtype=dtype, max_num_seqs=max(batches), enable_prefix_caching=False)
    plain = ts.LLM(**kw)
    speculative = ts.LLM(speculative=ts.SpeculativeConfig(num_tokens=num_tokens), **kw)
    params = ts.SamplingParams(temperature=0.0, max_tokens=new_tokens)
    rows = []
    for workload, texts in (("repetitive", REPETITIVE), ("free-form", FREE_FORM)):
        for batch in batches:
            chats = [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(max(batch, len(texts)))]
            batches_of = [chats[i:i + batch] for i in range(0, len(chats), batch)]   # every prompt at batch 1
            row = {"workload": workload, "batch": batch}
            for name, llm in (("plain", plain), ("speculative", speculative)):
                llm.chat(batches_of[0], params, use_tqdm=False)                      # warm-up
                outputs = [o for b in batches_of for o in llm.chat(b, params, use_tqdm=False)]
                row[f"{name}_ms"] = statistics.median(
                    (o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1)
                    for o in outputs if len(o.token_ids) > 1) * 1e3
                row[f"{name}_tokens"] = sum(len(o.token_ids) for o in outputs)
                if name == "speculative":
                    lengths = [o.metrics.mean_accept_length for o in outputs if o.metrics.mean_accept_length]
                    row["accept_length"] = statistics.mean(lengths) if lengths else None
            row["speedup"] = row["plain_ms"] / row["speculative_ms"]
            rows.append(row)
            print(common.table([row], list(row)), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=list(common.DENSE_SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--json", default="results/decode.json")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="instead: the default model with K n-gram drafts per step against none")
    parser.add_argument("--model", default=None, help="with --speculative: a model other than the default")
    parser.add_argument("--skip-kernels", nargs="+", default=[], metavar="MODULE.KERNEL",
                        help="Triton kernels that launch nothing: a bound on fusing them away (tokens wrong)")
    args = parser.parse_args()
    if args.speculative:
        rows = speculative_rows(args.speculative, args.batches, args.new_tokens, args.model)
        print(f"\n# speculative decoding (n-gram, {args.speculative} drafts), default model, "
              f"{common.device_name()}, commit {common.git_commit()}")
        print(common.table(rows, list(rows[0])))
        common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                      "rows": rows})
        return
    bandwidth = common.copy_bandwidth()
    rows = []
    with common.kernels_skipped(args.skip_kernels):
        for shape in args.shapes:
            bench_shape(shape, args.batches, args.new_tokens, bandwidth, not args.no_peers, rows, args.json,
                        tuple(args.skip_kernels))
    columns = ["shape", "batch", "ours_ms", "ours_sync_ms", "floor_ms", "x_floor", "hf_eager_ms",
               "hf_generate_compile_ms", "hf_compile_ms", "x_vs_compile", "kernels_per_step", "startup_s", "graph_mem_mb"]
    skipped = f", kernels skipped (tokens wrong): {' '.join(args.skip_kernels)}" if args.skip_kernels else ""
    print(f"\n# decode, bf16, prompt {PROMPT}, {common.device_name()}, commit {common.git_commit()}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s{skipped}")
    print(common.table(rows, columns))


if __name__ == "__main__":
    main()
