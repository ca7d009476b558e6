"""Serving: the OpenAI server (in-process, on loopback) under 1, 16 and 64 concurrent
streaming clients, against offline ``generate`` of the same requests.

    python -m benchmarks.serve [--shape smollm2-135m] [--concurrency 1 16 64]

Per concurrency: TTFT, TPOT and inter-token latency (p50, p99) and output tokens/s
through the server; offline, the median per-request TPOT and output tokens/s of
``generate`` over the same prompts. Targets: server TPOT within 1.1x of offline at 16
clients, and at 64 clients at least 0.8x of offline throughput. Random weights of the
shape (speed only); prompts are random token ids, outputs a fixed length; prefix caching
off (the warm-up repeats the first prompts).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import uvicorn

import tokenspeed as ts
from benchmarks import common
from tokenspeed.entrypoints.bench import random_prompts
from tokenspeed.entrypoints.openai.server import create_app
from tokenspeed.models.random import TINY_LLAMA, random_model


def start_server(llm, port: int):
    server = uvicorn.Server(uvicorn.Config(create_app(llm, "bench"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def offline(llm, prompts, output_len: int, concurrency: int) -> dict:
    params = ts.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:concurrency], params, use_tqdm=False)               # warm up
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(prompts), concurrency):                            # waves of `concurrency`
        outputs += llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tpot = [(o.metrics.finish_time - o.metrics.first_token_time) / (len(o.token_ids) - 1) for o in outputs]
    return {"offline_tpot_ms": statistics.median(tpot) * 1e3,
            "offline_tok_s": sum(len(o.token_ids) for o in outputs) / elapsed}


def served(port: int, num_prompts: int, input_len: int, output_len: int, concurrency: int,
           seed: int) -> dict:
    """``tokenspeed bench serve`` in its own process, as a client would be (in this one it
    would take the interpreter lock from the server it measures)."""
    with tempfile.TemporaryDirectory() as folder:
        summary = Path(folder) / "summary.json"
        for prompts, out in ((concurrency, None), (num_prompts, summary)):   # warm-up, then measure
            command = [sys.executable, "-m", "tokenspeed", "bench", "serve", "--base-url",
                       f"http://127.0.0.1:{port}", "--num-prompts", str(prompts), "--input-len",
                       str(input_len), "--output-len", str(output_len), "--max-concurrency",
                       str(concurrency), "--seed", str(seed)] + (["--output-json", str(out)] if out else [])
            subprocess.run(command, check=True, capture_output=True)
        s = json.loads(summary.read_text())
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
    shape = TINY_LLAMA if args.shape == "tiny" else common.SHAPES[args.shape]   # tiny: CPU trials
    model = random_model(shape, dtype=dtype, device=device)
    llm = ts.LLM(model, device=device, max_num_seqs=max(args.concurrency), enable_prefix_caching=False,
                 max_model_len=args.input_len + args.output_len + 16)
    server, rows = start_server(llm, args.port), []
    for c in args.concurrency:
        prompts = random_prompts(args.waves * c, args.input_len, llm.config.vocab_size, seed=c)
        row = {"shape": args.shape, "clients": c,
               **served(args.port, len(prompts), args.input_len, args.output_len, c, seed=c),
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
