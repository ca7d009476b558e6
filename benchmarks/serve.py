"""Serving: the OpenAI server (on loopback, its engine in its own process) under 1, 16 and 64 concurrent
streaming clients, against offline ``generate`` of the same requests.

    python -m benchmarks.serve [--shape smollm2-135m] [--concurrency 1 16 64] [--repeats 3] [--api-servers 2]

Per concurrency: TTFT, TPOT and inter-token latency (p50, p99) and output tokens/s
through the server; offline, the median per-request TPOT and output tokens/s of
``generate`` over the same prompts (in waves of ``concurrency``: every prompt of a wave
is computed before its first token), and in process, the served workload without HTTP
(``closed_``: ``concurrency`` requests in the engine, each finished one replaced by the
next, as the clients do; with outputs of one length they finish together, so this loop
runs in waves too, where clients drift apart); with ``--repeats``, the medians of several
rounds, and the throughput ratio's range. Targets: server TPOT within 1.1x of
offline at 16 clients, and at 64 clients at least 0.8x of offline throughput; the
``server_`` ratios compare with the closed loop instead. Random weights of the
shape (speed only); prompts are random token ids, outputs a fixed length; prefix caching
off (the warm-up repeats the first prompts).
"""

import argparse
import contextlib
import functools
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

import tokenspeed as ts
from benchmarks import common
from tokenspeed.cli.bench import random_prompts
from tokenspeed.cli.bench_serve import RequestResult, summarize
from tokenspeed.server.engine_process import EngineSpec
from tokenspeed.server.openai.api_servers import serve_many
from tokenspeed.server.openai.server import create_app, uvicorn_config
from tokenspeed.api.prompts import Prompt
from tokenspeed.models.random import TINY_LLAMA, random_model

CLIENTS_PER_PROCESS = 8      # the default; --clients-per-process


def bench_llm(shape: str, device: str, admit_every: int | None = None, **options):
    """The benchmark's engine; module-level, so the server's engine process can build it.
    ``admit_every``: the engine's admission interval in decode steps, where given."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_model(TINY_LLAMA if shape == "tiny" else common.SHAPES[shape], dtype=dtype, device=device)
    llm = ts.LLM(model, device=device, **options)
    if admit_every is not None:
        llm.engine.admit_every = admit_every
    return llm


def start_server(spec: EngineSpec, port: int, api_servers: int):
    """The server, in a thread of this process (one API server) or in a process of its own
    (``api_servers`` of them); returns the call that stops it."""
    if api_servers > 1:
        return _start_api_servers(spec, port, api_servers)
    server = uvicorn.Server(uvicorn_config(create_app(spec, "bench"), "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start (see its log above)")
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join()            # the app's shutdown stops the engine process
    return stop


def _start_api_servers(spec: EngineSpec, port: int, count: int):
    parent = multiprocessing.get_context("spawn").Process(
        target=serve_many, args=(spec, "bench", "127.0.0.1", port, None, count, "warning"))
    parent.start()
    while True:
        if not parent.is_alive():
            raise RuntimeError("the servers did not start (see their log above)")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        time.sleep(0.2)

    def stop():
        parent.terminate()       # as SIGTERM: it stops its servers, and so the engine
        parent.join()
    return stop


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


def closed_loop(llm, prompts, output_len: int, concurrency: int) -> dict:
    """The served workload stepped in this process, without the server."""
    params = ts.SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    queue, live, done = [Prompt(tuple(p)) for p in prompts], [], []
    start = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            live += llm.add([queue.pop(0)], [params])[0]
        llm.step()
        finished = [r for r in live if r.finished]
        live = [r for r in live if not r.finished]
        done += finished
        llm.release(finished)
    elapsed = time.perf_counter() - start
    tpot = [(r.finish_time - r.first_token_time) / (len(r.output) - 1) for r in done]
    return {"closed_tpot_ms": statistics.median(tpot) * 1e3,
            "closed_tok_s": sum(len(r.output) for r in done) / elapsed}


def served(port: int, num_prompts: int, input_len: int, output_len: int, concurrency: int,
           seed: int, per_process: int = CLIENTS_PER_PROCESS) -> dict:
    """``tokenspeed bench serve`` in processes of their own, as clients would be: one
    process per 8 clients (one Python client parses ~10k events/s; with 16 per process,
    each had to take ~9k at 64 clients, and runs where clients fell behind read tokens in
    bursts, ITL p50 0, and sent their next requests late), all starting at one wall-clock time, their requests' figures
    merged over the span from the first start to the last end."""
    processes = -(-concurrency // per_process)
    for prompts in (concurrency, num_prompts):                            # warm-up, then measure
        results, spans = _clients(port, prompts, input_len, output_len, concurrency, processes, seed)
    duration = max(end for _, end in spans) - min(start for start, _ in spans)
    s = summarize(results, duration)
    return {"ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p99_ms": s["ttft_ms"]["p99"],
            "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p99_ms": s["tpot_ms"]["p99"],
            "itl_p50_ms": s["itl_ms"]["p50"], "itl_p99_ms": s["itl_ms"]["p99"],
            "served_tok_s": s["output_throughput"], "failed": s["failed"],
            **client_diagnostics(results, spans, duration)}


def client_diagnostics(results, spans, duration: float) -> dict:
    """Where a served run's clients spent the span: requests in flight on average (their
    latencies over the span; the concurrency if no client ever waited between requests),
    and how far apart the client processes started and ended."""
    starts, ends = [s for s, _ in spans], [e for _, e in spans]
    return {"in_flight": sum(r.latency for r in results if r.ok) / duration,
            "start_skew_s": max(starts) - min(starts), "end_skew_s": max(ends) - min(ends)}


def _clients(port, num_prompts, input_len, output_len, concurrency, processes, seed):
    """Every client process is released once all are set up: started at a wall-clock time
    instead (5 s after the launch), they started up to 1.2 s apart on the H200's host (its
    imports, beside the engine), and the span they were measured over grew by as much."""
    with tempfile.TemporaryDirectory() as folder:
        running = []
        for k in range(processes):
            out = Path(folder) / f"client{k}.json"
            command = [sys.executable, "-m", "tokenspeed", "bench", "serve", "--base-url",
                       f"http://127.0.0.1:{port}", "--num-prompts", str(num_prompts // processes),
                       "--input-len", str(input_len), "--output-len", str(output_len),
                       "--max-concurrency", str(concurrency // processes), "--seed", str(seed * 100 + k),
                       "--output-json", str(out), "--start-on-stdin"]
            running.append((subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.PIPE), out))
        for process, _ in running:
            if process.stdout.readline().strip() != b"ready":
                for other, _ in running:    # none of them starts: their stdin closes
                    other.kill()
                raise RuntimeError(f"a client failed to start: {process.communicate()[1].decode()}")
        for process, _ in running:
            process.stdin.write(b"go\n")
            process.stdin.flush()
        results, spans = [], []
        for process, out in running:
            _, errors = process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"a client failed: {errors.decode()}")
            s = json.loads(out.read_text())
            results += [RequestResult(**{**r, "itl": tuple(r["itl"])}) for r in s["requests"]]
            spans.append((s["start_time"], s["end_time"]))
    return results, spans


def measure(args, llm, prompts, concurrency: int) -> dict:
    """One round: served, offline and in-process figures of ``prompts``, and their ratios."""
    c = concurrency
    row = {**served(args.port, len(prompts), args.input_len, args.output_len, c, seed=c,
                    per_process=args.clients_per_process),
           **offline(llm, prompts, args.output_len, c),
           **closed_loop(llm, prompts, args.output_len, c)}
    row["tpot_ratio"] = row["tpot_p50_ms"] / row["offline_tpot_ms"]
    row["throughput_ratio"] = row["served_tok_s"] / row["offline_tok_s"]
    row["server_tpot_ratio"] = row["tpot_p50_ms"] / row["closed_tpot_ms"]
    row["server_throughput_ratio"] = row["served_tok_s"] / row["closed_tok_s"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m", help="a benchmark shape, or tiny (CPU trials)")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--waves", type=int, default=8, help="prompts per run = waves * concurrency")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds per concurrency (served, offline, in-process): the row is their "
                             "median, with the throughput ratio's range (runs of one tree spread widely)")
    parser.add_argument("--port", type=int, default=8321)
    parser.add_argument("--api-servers", type=int, default=1, help="HTTP processes over the one engine")
    parser.add_argument("--clients-per-process", type=int, default=CLIENTS_PER_PROCESS,
                        help="streaming clients per client process (each parses ~10k events/s)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the server sends a completion's tokens every N (serve --stream-interval)")
    parser.add_argument("--admit-every", type=int, default=None,
                        help="decode steps between admissions while a chain runs (the engine's default if unset)")
    parser.add_argument("--json", default="results/serve.json")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    build = functools.partial(bench_llm, args.shape, device, args.admit_every, max_num_seqs=max(args.concurrency),
                              enable_prefix_caching=False, num_kv_pages=4096,
                              max_model_len=args.input_len + args.output_len + 16)
    llm = build()                                  # offline, in this process
    spec = EngineSpec(build, stream_interval=args.stream_interval)
    stop, rows = start_server(spec, args.port, args.api_servers), []   # its twin, in the server's
    for c in args.concurrency:
        prompts = random_prompts(args.waves * c, args.input_len, llm.config.vocab_size, seed=c)
        rounds = [measure(args, llm, prompts, c) for _ in range(args.repeats)]
        ratios = [r["throughput_ratio"] for r in rounds]
        row = {"shape": args.shape, "api_servers": args.api_servers, "stream_interval": args.stream_interval,
               "admit_every": llm.engine.admit_every,
               "clients": c,
               "client_processes": -(-c // args.clients_per_process), "rounds": len(rounds),
               **{k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
               "throughput_ratio_min": min(ratios), "throughput_ratio_max": max(ratios)}
        rows.append(row)
        print(common.table([row], list(row)), flush=True)
    stop()
    print(f"\n# serving, {args.shape}, {common.device_name()}, commit {common.git_commit()}")
    print(common.table(rows, list(rows[0])))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(), "rows": rows})


if __name__ == "__main__":
    main()
