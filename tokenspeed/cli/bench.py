"""``tokenspeed bench latency|throughput`` (offline figures in the format vLLM's
``benchmark latency`` and ``benchmark throughput`` print, on random token prompts) and
``tokenspeed bench serve`` (``bench_serve``)."""

import json
import statistics
import time

from tokenspeed.cli.arg_types import at_least, file_to_write
from tokenspeed.execution.ladders import MAX_NUM_SEQS

PERCENTILES = (10, 25, 50, 75, 90, 99)
DESCRIPTION = ("measure the engine offline (latency, throughput: random token prompts, reported as vLLM's "
               "benchmarks report them) or a running server (serve)")


def add_command(commands, engine_options) -> None:
    bench = commands.add_parser("bench", help="measure latency or throughput, offline or of a server",
                                description=DESCRIPTION).add_subparsers(dest="kind", required=True)
    latency = _offline_command(bench, "latency", "time one batch end to end, repeatedly", engine_options,
                               input_len=32, run=run_latency)
    latency.add_argument("--batch-size", type=at_least(1, MAX_NUM_SEQS), default=8,
                         help="requests in the batch, run at once")
    latency.add_argument("--num-iters-warmup", type=at_least(0), default=2, help="untimed runs first")
    latency.add_argument("--num-iters", type=at_least(1), default=10, help="timed runs")
    throughput = _offline_command(bench, "throughput", "serve many requests at once", engine_options,
                                  input_len=128, run=run_throughput)
    throughput.add_argument("--num-prompts", type=at_least(1), default=256, help="requests to serve")
    throughput.add_argument("--max-num-seqs", type=at_least(1, MAX_NUM_SEQS), default=64,
                            help="requests running at once")
    from tokenspeed.cli import bench_serve
    bench_serve.add_command(bench)


def _offline_command(bench, name: str, help_text: str, engine_options, input_len: int, run):
    """A command that loads the model itself, with the lengths and the JSON output both take."""
    command = bench.add_parser(name, help=help_text, description=help_text)
    engine_options(command)
    command.add_argument("--input-len", type=at_least(1), default=input_len, help="prompt tokens per request")
    command.add_argument("--output-len", type=at_least(1), default=128, help="tokens generated per request")
    command.add_argument("--output-json", type=file_to_write, default=None,
                         help="also write the figures to this JSON file")
    command.set_defaults(run=run)
    return command


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch   # here, not at the top: ``tokenspeed --help`` imports this module
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (count, length), generator=generator).tolist()


def percentiles(values: list[float]) -> dict[int, float]:
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {p: cuts[p - 1] for p in PERCENTILES}


def _fixed_length(output_len: int):
    """Exactly ``output_len`` tokens: EOS ignored (``min_tokens`` would also do, but it
    sends every row through the post-step sampler and stops the overlap)."""
    from tokenspeed.execution.sampling_params import SamplingParams
    return SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)


def _check_lengths(args, llm) -> None:
    """The bench's lengths against the context, in its own flags' words."""
    total, most = args.input_len + args.output_len, llm.engine.limits.max_model_len
    if total > most:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} = {total} exceeds "
                         f"max_model_len={most} (the model's context, or --max-model-len)")


def run_latency(args) -> None:
    from tokenspeed.cli.main import load_llm
    llm = load_llm(args, max_num_seqs=args.batch_size, enable_prefix_caching=False)  # repeats
    _check_lengths(args, llm)
    prompts = random_prompts(args.batch_size, args.input_len, llm.config.vocab_size)
    params = _fixed_length(args.output_len)
    for _ in _runs(args.num_iters_warmup, "warm-up runs"):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in _runs(args.num_iters, "timed runs"):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    print(f"Avg latency: {statistics.mean(latencies)} seconds")
    for p, value in percentiles(latencies).items():
        print(f"{p}% percentile latency: {value} seconds")
    _write(args.output_json, {"avg_latency": statistics.mean(latencies), "latencies": latencies,
                              "percentiles": percentiles(latencies)})


def _runs(count: int, desc: str):
    """``range(count)`` with a progress bar on a terminal's stderr: the default batch on
    the CPU takes seconds a run, and twelve runs without a sign of life read as a hang.
    The bar moves between runs, outside the timed span."""
    from tqdm import tqdm
    return tqdm(range(count), desc=desc, unit="run", disable=None, leave=False, dynamic_ncols=True)


def run_throughput(args) -> None:
    from tokenspeed.cli.main import load_llm
    llm = load_llm(args, max_num_seqs=args.max_num_seqs, enable_prefix_caching=False)
    _check_lengths(args, llm)
    prompts = random_prompts(args.num_prompts, args.input_len, llm.config.vocab_size)
    params = _fixed_length(args.output_len)
    llm.generate(prompts[:min(len(prompts), args.max_num_seqs)], params, use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs)
    generated = sum(len(o.token_ids) for o in outputs)
    print(f"Throughput: {len(outputs) / elapsed:.2f} requests/s, {total / elapsed:.2f} total tokens/s, "
          f"{generated / elapsed:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {total - generated}")
    print(f"Total num output tokens:  {generated}")
    _write(args.output_json, {"elapsed_time": elapsed, "num_requests": len(outputs),
                              "total_num_tokens": total, "requests_per_second": len(outputs) / elapsed,
                              "tokens_per_second": total / elapsed})


def _write(path, payload) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
