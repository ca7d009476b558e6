"""Serving: the OpenAI server (in-process, on loopback) under 1, 16 and 64 concurrent
streaming clients, against offline ``generate`` of the same requests.

    python -m benchmarks.serve [--shape smollm2-135m] [--concurrency 1 16 64]

Per concurrency: TTFT, TPOT and inter-token latency (p50, p99) and output tokens/s
through the server; offline, the median per-request TPOT and output tokens/s of
``generate`` over the same prompts. Targets: server TPOT within 1.1x of offline at 16
clients, and at 64 clients at least 0.8x of offline throughput. Random weights of the
shape (speed only); prompts are random token ids, outputs a fixed length.
"""

import argparse
import asyncio
import statistics
import threading
import time

import torch
import uvicorn

import tokenspeed as ts
from benchmarks import common
from tokenspeed.entrypoints import bench_serve
from tokenspeed.entrypoints.bench import random_prompts
from tokenspeed.entrypoints.openai.server import create_app
from tokenspeed.models.random import random_model


def start_server(llm, port: int):
    server = uvicorn.Server(uvicorn.Config(create_app(llm, "bench"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def offline(llm, prompts, output_len: int, concurrency: int) -> dict:
    params = ts.SamplingParams(temperature=0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:concurrency], params, use_tqdm=False)               # warm up
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), concurrency):                            # waves of `concurrency`
        outputs += llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1) for o in outputs]
    return {"offline_tpot_ms": statistics.median(tpot) * 1e3,
            "offline_tok_s": sum(len(o.token_ids) for o in outputs) / elapsed}


def served(port: int, prompts, output_len: int, concurrency: int) -> dict:
    spec = bench_serve.LoadSpec(f"http://127.0.0.1:{port}", "bench", prompts, output_len,
                                float("inf"), concurrency)
    asyncio.run(bench_serve.drive(bench_serve.LoadSpec(spec.base_url, "bench", prompts[:concurrency],
                                                       output_len, float("inf"), concurrency)))
    results, duration = asyncio.run(bench_serve.drive(spec))
    s = bench_serve.summarize(results, duration)
    return {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
            "served_tok_s": s["output_throughput"], "failed": s["failed"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=4, help="prompts per run = waves * concurrency")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--json", default="results/serve.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(common.SHAPES[args.shape], dtype=dtype, device=device)
    llm = ts.LLM(model, device=device, max_num_seqs=max(args.concurrency),
                 max_model_len=args.input_len + args.output_len + 16)
    server, rows = start_server(llm, args.port), []
    for c in args.concurrency:
        prompts = random_prompts(args.waves * c, args.input_len, llm.config.vocab_size, seed=c)
        row = {"shape": args.shape, "clients": c, **served(args.port, prompts, args.output_len, c),
               **offline(llm, prompts, args.output_len, c)}
        row["tpot_ratio"] = row["tpot_p50_ms"] / row["offline_tpot_ms"]
        row["throughput_ratio"] = row["served_tok_s"] / row["offline_tok_s"]
        rows.append(row)
        print(common.table([row], list(row)), flush=True)
    server.should_exit = True
    print(f"\n# serving, {args.shape}, {common.device_name()}, commit {common.git_commit()}")
    print(common.table(rows, list(rows[0])))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(), "rows": rows})


if __name__ == "__main__":
    main()
