"""Offline throughput of seeded workloads against the work's floor, with a step timeline.

    python -m benchmarks.throughput [--shapes llama-3.2-1b qwen2.5-0.5b] [--workloads ...]
                                    [--max-num-seqs 128] [--peers] [--shape tiny (CPU trial)]
    python -m benchmarks.throughput --shapes qwen3-30b-a3b deepseek-v2-lite --workloads mixed

Per workload: requests/s, input and output tokens/s, the prefix-cache hit rate, and the
floor: prefill FLOPs at the measured matmul peak, plus decode steps that each read the
weights once (or compute at the peak, whichever is longer) and every output token's KV
once, at the measured copy bandwidth. The timeline splits wall time into decode-only steps
and steps with prompt work, and, from a profiled second run, into GPU-busy time and the
host time the GPU waited for. ``--peers``: Hugging Face ``generate`` (static cache,
compiled) in padded batches of ``--max-num-seqs`` on the first requests; ``--multi-turn``:
time to first token of 512 new tokens after an 8k cached prefix against a fresh prompt;
``--profile``: the top kernels and host functions of each workload.
"""

import argparse
import cProfile
import pstats
import random
import time

import attrs
import torch

import tokenspeed as ts
from benchmarks import common, moe_bytes
from tokenspeed.models.random import TINY_LLAMA, random_model


@attrs.frozen
class Workload:
    name: str
    num_requests: int
    prompt_lens: tuple[int, int]
    output_lens: tuple[int, int]
    shared_prefix: int = 0          # tokens every prompt starts with (prefix caching)

    def requests(self, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
        rng = random.Random(f"{self.name}/{seed}")   # a string seed is stable across runs
        prefix = [rng.randrange(vocab) for _ in range(self.shared_prefix)]
        return [(prefix + [rng.randrange(vocab) for _ in range(rng.randint(*self.prompt_lens))],
                 rng.randint(*self.output_lens)) for _ in range(self.num_requests)]


WORKLOADS = {w.name: w for w in (
    Workload("mixed", 512, (64, 1024), (32, 256)),
    Workload("short-prompt-long-output", 256, (32, 128), (256, 512)),
    Workload("long-prompt-short-output", 256, (1024, 2048), (16, 64)),
    Workload("shared-prefix", 256, (32, 256), (32, 128), shared_prefix=1024),
)}
TINY_WORKLOAD = {"prompt_lens": (8, 64), "output_lens": (4, 32), "num_requests": 32}


@attrs.frozen
class Peaks:
    matmul_flops: float     # FLOP/s
    copy_bytes: float       # bytes/s


def measure_peaks(device: str) -> Peaks:
    if device != "cuda":
        return Peaks(1e11, 2e10)  # nominal CPU figures: the CPU run is a trial, not a result
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    seconds = common.gpu_time(lambda: a @ a, iters=20)
    return Peaks(2 * 8192**3 / seconds, common.copy_bandwidth())


def work_floor(model, requests, max_num_seqs: int, peaks: Peaks, shared_prefix: int = 0) -> float:
    """Seconds the workload needs at least on this device, as the issue defines it: prompt
    FLOPs at the matmul peak (a prefix all prompts share computed once), plus decode steps
    that each read the weights (or compute at the peak) and every output token's KV at the
    copy bandwidth. Decode rows that ride in prompt steps share those steps' weight reads,
    so an engine could in principle go a little under it. A mixture of experts computes a
    token through its k experts only, and a step reads the experts its rows are expected to
    touch (``moe_bytes``: uniform routing)."""
    cfg = model.config
    head = cfg.vocab_size * cfg.hidden_size
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    body -= 0 if cfg.tie_word_embeddings else head
    routed = moe_bytes.routed_bytes(model) if moe_bytes.is_mixture(cfg) else 0
    routing = moe_bytes.routing_of(cfg) if routed else moe_bytes.Routing(1, 1)
    body -= routed // next(model.parameters()).element_size() * (1 - routing.top_k / routing.experts)
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim      # FLOPs per (query, key)

    def prompt_flops(length: int, cached: int) -> float:
        new = length - cached
        return 2 * body * new + 2 * head + attention * (new * cached + new ** 2 / 2)
    prefill = sum(prompt_flops(len(p), shared_prefix if i else 0) for i, (p, _) in enumerate(requests))
    rows = sum(n - 1 for _, n in requests)
    steps = max(-(-rows // max_num_seqs), max(n for _, n in requests) - 1)
    per_row = common.kv_bytes(cfg, 1, 1)
    kv = sum(per_row * (len(p) + t) for p, n in requests for t in range(1, n))
    weights = common.weight_bytes(model) - routed + routed * routing.touched_fraction(max(1, rows // steps))
    step = max(weights / peaks.copy_bytes, 2 * (body + head) * rows / steps / peaks.matmul_flops)
    return prefill / peaks.matmul_flops + steps * step + kv / peaks.copy_bytes


class StepTimeline:
    """Wall time of every engine step, split by whether the step carried prompt work: a
    prefill launch with a chunk of more than one token (a chained step's extend too, which
    the engine schedules without ``Scheduler.schedule``)."""

    def __init__(self, engine):
        self.seconds = {"decode": 0.0, "prefill": 0.0}
        self.steps = {"decode": 0, "prefill": 0}
        self._kind = "decode"
        launch, step = engine.prefill.launch, engine.step

        def timed_launch(chunks, *args, **kwargs):
            if any(len(c.tokens) > 1 for c in chunks):
                self._kind = "prefill"
            return launch(chunks, *args, **kwargs)

        def timed_step():
            self._kind, start = "decode", time.perf_counter()
            finished = step()
            self.seconds[self._kind] += time.perf_counter() - start
            self.steps[self._kind] += 1
            return finished
        engine.prefill.launch, engine.step = timed_launch, timed_step


def run_workload(llm, requests) -> tuple[float, list]:
    prompts = [p for p, _ in requests]
    params = [ts.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def gpu_busy_seconds(llm, requests, show: bool) -> tuple[float, float]:
    """(wall, GPU-busy) seconds of a profiled run: the difference is time the GPU waited.
    ``show``: print the top kernels and, from a second run, the top host functions."""
    if not torch.cuda.is_available():
        return run_workload(llm, requests)[0], float("nan")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall, _ = run_workload(llm, requests)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    if show:
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
        host = cProfile.Profile()
        host.runcall(run_workload, llm, requests)
        pstats.Stats(host).sort_stats("tottime").print_stats(25)
    return wall, busy


def bench_workload(llm, model, workload: Workload, peaks: Peaks, max_num_seqs: int, show: bool) -> dict:
    requests = workload.requests(llm.config.vocab_size)              # other seeds: nothing cached
    run_workload(llm, workload.requests(llm.config.vocab_size, seed=1)[:max_num_seqs])   # warm-up
    engine_step, scheduler_schedule = llm.engine.step, llm.engine.scheduler.schedule
    timeline = StepTimeline(llm.engine)
    wall, outputs = run_workload(llm, requests)
    llm.engine.step, llm.engine.scheduler.schedule = engine_step, scheduler_schedule
    profiled_wall, busy = gpu_busy_seconds(llm, workload.requests(llm.config.vocab_size, seed=2), show)
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    floor = work_floor(model, requests, max_num_seqs, peaks, workload.shared_prefix)
    return {"workload": workload.name, "requests": len(requests), "seconds": wall,
            "req_s": len(requests) / wall, "in_tok_s": prompt_tokens / wall,
            "out_tok_s": output_tokens / wall, "floor_s": floor, "x_floor": wall / floor,
            "hit_rate": sum(o.metrics.num_cached_tokens for o in outputs) / prompt_tokens,
            "decode_steps": timeline.steps["decode"], "decode_s": timeline.seconds["decode"],
            "prefill_steps": timeline.steps["prefill"], "prefill_s": timeline.seconds["prefill"],
            "gpu_busy_s": busy, "gpu_waited_s": profiled_wall - busy}


def hf_peer(shape: str, requests, batch: int) -> dict:
    """Hugging Face ``generate`` with a static cache and compiled step, left-padded batches:
    each batch runs to its longest output, only requested tokens count."""
    from transformers import CompileConfig
    hf = common.hf_model(shape)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None, cache_implementation="static",
              compile_config=CompileConfig(fullgraph=True, mode="reduce-overhead"))

    def run(chunk):
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device="cuda")
        longest = max(n for _, n in chunk)
        hf.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, **kw)

    with torch.inference_mode():
        run(requests[:batch])                                        # compiles
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(0, len(requests), batch):
            run(requests[i:i + batch])
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"hf_requests": len(requests), "hf_out_tok_s": sum(n for _, n in requests) / seconds}


def multi_turn_ttft(llm, vocab: int, cached: int = 8192, new: int = 512, warmup: int = 5) -> dict:
    """TTFT of ``new`` tokens after ``cached`` cached ones, against ``new`` fresh tokens,
    after ``warmup`` untimed turns: a process's first five turns ran both slower (the fresh
    prompt 3.57 against 2.17 ms on the H200, docs/PERFORMANCE.md), and their ratio better."""
    rng = random.Random(1)
    history = [rng.randrange(vocab) for _ in range(cached)]
    one = ts.SamplingParams(temperature=0.0, max_tokens=1)

    def ttft(prompt):
        return run_workload(llm, [(prompt, 1)])[0]
    follow_ups, fresh = [], []
    for turn in range(warmup + 5):
        turn_tokens = [rng.randrange(vocab) for _ in range(new)]
        llm.generate([history], one, use_tqdm=False)                 # the conversation so far, cached
        follow_ups.append(ttft(history + turn_tokens))
        fresh.append(ttft([rng.randrange(vocab) for _ in range(new)]))
    follow_up, first = sorted(follow_ups[warmup:])[2], sorted(fresh[warmup:])[2]
    return {"cached": cached, "new": new, "follow_up_ttft_ms": follow_up * 1e3,
            "fresh_ttft_ms": first * 1e3, "ratio": follow_up / first}


def bench_shape(shape: str, names, args, peaks: Peaks) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = TINY_LLAMA if shape == "tiny" else common.SHAPES[shape]
    model = random_model(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    llm = ts.LLM(model, device=device, max_num_seqs=args.max_num_seqs, max_model_len=min(
        config["max_position_embeddings"], 16384), num_kv_pages=args.num_kv_pages)
    rows = []
    for name in names:
        workload = WORKLOADS[name]
        if shape == "tiny":
            workload = attrs.evolve(workload, shared_prefix=min(workload.shared_prefix, 64), **TINY_WORKLOAD)
        row = {"shape": shape, **bench_workload(llm, model, workload, peaks, args.max_num_seqs, args.profile)}
        if args.peers and device == "cuda":
            sample = workload.requests(llm.config.vocab_size)[:args.peer_requests]
            row.update(hf_peer(shape, sample, args.max_num_seqs))
            row["x_vs_hf"] = row["out_tok_s"] / row["hf_out_tok_s"]
        rows.append(row)
        print(common.table([row], list(row)), flush=True)
    if args.multi_turn and shape != "tiny":
        print(common.table([multi_turn_ttft(llm, llm.config.vocab_size)], ["cached", "new", "follow_up_ttft_ms",
                                                                          "fresh_ttft_ms", "ratio"]))
    del llm, model
    common.release_memory()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="+", default=["llama-3.2-1b", "qwen2.5-0.5b"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--num-kv-pages", type=int, default=None)
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--peer-requests", type=int, default=128)
    parser.add_argument("--multi-turn", action="store_true")
    parser.add_argument("--profile", action="store_true", help="print top kernels and host functions")
    parser.add_argument("--json", default="results/throughput.json")
    args = parser.parse_args()
    peaks = measure_peaks("cuda" if torch.cuda.is_available() else "cpu")
    rows = [r for shape in args.shapes for r in bench_shape(shape, args.workloads, args, peaks)]
    print(f"\n# offline throughput, bf16, max_num_seqs {args.max_num_seqs}, {common.device_name()}, "
          f"commit {common.git_commit()}, matmul peak {peaks.matmul_flops / 1e12:.0f} TFLOP/s, "
          f"copy bandwidth {peaks.copy_bytes / 1e12:.2f} TB/s")
    columns = ["shape", "workload", "seconds", "req_s", "in_tok_s", "out_tok_s", "floor_s", "x_floor",
               "hit_rate", "decode_s", "prefill_s", "gpu_waited_s", "hf_out_tok_s", "x_vs_hf"]
    print(common.table(rows, columns))
    common.write_json(args.json, {"commit": common.git_commit(), "device": common.device_name(),
                                  "peaks": attrs.asdict(peaks), "rows": rows})


if __name__ == "__main__":
    main()
