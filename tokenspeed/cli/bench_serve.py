"""``tokenspeed bench serve``: drive a running server with streamed completions at a
request rate (Poisson arrivals) and a concurrency limit; print TTFT, TPOT and inter-token
latency (mean, p50, p90, p99) and throughput in the layout vLLM's ``bench serve`` uses."""

import asyncio
import json
import random
import statistics
import sys
import time

import attrs
import httpx

from tokenspeed.cli.arg_types import at_least, file_to_write, positive_float


@attrs.frozen
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    itl: tuple[float, ...]
    error: str = ""


@attrs.frozen
class LoadSpec:
    base_url: str
    model: str | None
    prompts: list
    output_len: int
    request_rate: float
    max_concurrency: int | None
    api_key: str | None = None
    seed: int = 0


def add_command(bench) -> None:
    serve = bench.add_parser("serve", help="load a running server (see tokenspeed serve)",
                             description="drive a running server with streamed completions and report TTFT, "
                                         "TPOT, inter-token latency and throughput as vLLM's bench serve does")
    serve.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's address")
    serve.add_argument("--model", default=None, help="the served model name (default: the server's)")
    serve.add_argument("--api-key", default=None, help="the server's key, if it asks for one")
    serve.add_argument("--num-prompts", type=at_least(1), default=64, help="requests to send")
    serve.add_argument("--input-len", type=at_least(1), default=128, help="prompt tokens per request (random ids)")
    serve.add_argument("--output-len", type=at_least(1), default=128, help="tokens generated per request")
    serve.add_argument("--request-rate", type=positive_float, default=float("inf"),
                       help="requests/s, Poisson arrivals (inf: all at once)")
    serve.add_argument("--max-concurrency", type=at_least(1), default=None,
                       help="requests in flight at most (default: no limit)")
    serve.add_argument("--seed", type=int, default=0, help="seed of the prompts and the arrivals")
    serve.add_argument("--output-json", type=file_to_write, default=None, help="also write the figures here")
    serve.add_argument("--start-at", type=float, default=None,
                       help="wall-clock time (seconds since the epoch) to start sending at, so "
                            "several client processes start together")
    serve.add_argument("--start-on-stdin", action="store_true",
                       help="print 'ready' once set up, then start sending when a line arrives on "
                            "stdin (a launcher releasing several client processes at once)")
    serve.set_defaults(run=run)


def run(args) -> None:
    from tokenspeed.cli.bench import random_prompts
    served = served_model(args.base_url, args.api_key, args.model)
    prompts = random_prompts(args.num_prompts, args.input_len, served["vocab_size"], args.seed)
    spec = LoadSpec(args.base_url, served["id"], prompts, args.output_len,
                    args.request_rate, args.max_concurrency, args.api_key, args.seed)
    if args.start_on_stdin:
        print("ready", flush=True)
        if not sys.stdin.readline():   # the launcher went away: send nothing
            raise SystemExit("bench serve: stdin closed before the start")
    elif args.start_at is not None:
        time.sleep(max(0.0, args.start_at - time.time()))
    started = time.time()
    results, duration = asyncio.run(drive(spec))
    summary = summarize(results, duration)
    print(report(summary))
    if args.output_json:   # every request's figures and the wall-clock span: runs merge
        with open(args.output_json, "w") as f:
            json.dump({**summary, "start_time": started, "end_time": started + duration,
                       "requests": [attrs.asdict(r) for r in results]}, f, indent=2)
    if not summary["completed"]:   # figures of nothing: the command failed
        raise ValueError(f"every one of the {len(results)} requests failed: " + "; ".join(summary["errors"]))


def served_model(base_url: str, api_key: str | None, name: str | None = None) -> dict:
    """The server's entry of the model ``name`` (None: its first), with its vocabulary, which
    the prompts are drawn from; a name the server does not serve is refused before a
    request is sent."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ConnectionError(f"cannot reach {base_url}: {exc}") from None
    if response.status_code != 200:
        raise ValueError(f"{base_url}/v1/models answered {response.status_code}: {response.text}")
    models = response.json()["data"]
    named = [m for m in models if name in (None, m["id"])]
    if not named:
        asked = "a model" if name is None else f"--model {name!r}"
        raise ValueError(f"{asked}: {base_url} serves {[m['id'] for m in models] or 'none'}")
    return named[0]


async def drive(spec: LoadSpec) -> tuple[list[RequestResult], float]:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limit = asyncio.Semaphore(spec.max_concurrency or len(spec.prompts))
    rng = random.Random(spec.seed)
    async with httpx.AsyncClient(base_url=spec.base_url, headers=headers, timeout=None,
                                 limits=httpx.Limits(max_connections=None)) as client:
        start, tasks = time.perf_counter(), []
        for prompt in spec.prompts:
            tasks.append(asyncio.create_task(_limited(limit, client, spec, prompt)))
            if spec.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(spec.request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def _limited(limit, client, spec: LoadSpec, prompt) -> RequestResult:
    async with limit:
        return await one_request(client, spec, prompt)


async def one_request(client, spec: LoadSpec, prompt) -> RequestResult:
    body = {"prompt": prompt, "max_tokens": spec.output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if spec.model:
        body["model"] = spec.model
    start, times, usage = time.perf_counter(), [], None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return _failed(prompt, (await response.aread()).decode())
            async for events in _events(response):
                now = time.perf_counter()
                for event in events:
                    if b'"usage"' not in event:   # a token's chunk: its arrival is all we need
                        times.append(now)          # (parsing each would make the client the bottleneck)
                        continue
                    data = json.loads(event)
                    if data.get("choices"):
                        times.append(now)
                    usage = data.get("usage") or usage
    except httpx.HTTPError as exc:
        return _failed(prompt, str(exc))
    if not times or usage is None:
        return _failed(prompt, "the stream ended without tokens or usage")
    itl = tuple(b - a for a, b in zip(times, times[1:]))
    return RequestResult(True, usage["prompt_tokens"], usage["completion_tokens"], times[0] - start,
                         times[-1] - start, itl)


async def _events(response):
    """The stream's server-sent events' data, as lists of those that arrived together: read as
    bytes and split in C (httpx's line iterator, in Python, kept one client process from
    reading more than about 10k events/s); ``[DONE]`` left out."""
    pending = b""
    async for raw in response.aiter_bytes():
        *complete, pending = (pending + raw).split(b"\n\n")
        events = [e.removeprefix(b"data: ") for e in complete if e.startswith(b"data: ")]
        yield [e for e in events if e != b"[DONE]"]


def _failed(prompt, error: str) -> RequestResult:
    return RequestResult(False, len(prompt), 0, 0.0, 0.0, (), error)


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out = sum(r.output_tokens for r in ok)
    total = out + sum(r.prompt_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
            "total_input_tokens": total - out, "total_output_tokens": out,
            "request_throughput": len(ok) / duration, "output_throughput": out / duration,
            "total_token_throughput": total / duration,
            "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    cuts = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    ms = 1e3
    return {"mean": statistics.mean(values) * ms, "p50": statistics.median(values) * ms,
            "p90": cuts[89] * ms, "p99": cuts[98] * ms}


def report(s: dict) -> str:
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             f"{'Successful requests:':<40}{s['completed']:<10}",
             f"{'Failed requests:':<40}{s['failed']:<10}",
             f"{'Benchmark duration (s):':<40}{s['duration_s']:<10.2f}",
             f"{'Total input tokens:':<40}{s['total_input_tokens']:<10}",
             f"{'Total generated tokens:':<40}{s['total_output_tokens']:<10}",
             f"{'Request throughput (req/s):':<40}{s['request_throughput']:<10.2f}",
             f"{'Output token throughput (tok/s):':<40}{s['output_throughput']:<10.2f}",
             f"{'Total Token throughput (tok/s):':<40}{s['total_token_throughput']:<10.2f}"]
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency")):
        name = key.split("_")[0].upper()
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        lines += [f"{label + ' ' + name + ' (ms):':<40}{s[key][stat]:<10.2f}"
                  for label, stat in (("Mean", "mean"), ("Median", "p50"), ("P90", "p90"), ("P99", "p99"))]
    lines.append("=" * 50)
    if s["errors"]:
        lines.append("errors: " + "; ".join(s["errors"]))
    return "\n".join(lines)
