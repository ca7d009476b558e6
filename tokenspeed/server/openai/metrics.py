"""Prometheus metrics of one server (its own registry: two servers in a process keep
apart): requests running and waiting, KV pages in use and of the pool (their ratio is
vLLM's cache usage), time to first token, time per output token, and token counters.

Several API-server processes over one engine (``api_servers``) share their metrics through
prometheus_client's multiprocess mode: each process writes its figures to files in one
folder (``PROMETHEUS_MULTIPROC_DIR``, set before the process imports prometheus_client),
and any of them answers ``/metrics`` with the sum of counters and histograms and the most
recent value of each gauge."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

from tokenspeed.api.messages import Completed, EngineLoad

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, multiprocess_dir: str | None = None):
        """``multiprocess_dir``: the folder of several processes' figures (see above)."""
        self.registry, self.multiprocess_dir = CollectorRegistry(), multiprocess_dir
        r = self.registry
        gauge = lambda name, text: Gauge(name, text, registry=r, multiprocess_mode="mostrecent")  # noqa: E731
        self.running = gauge("tokenspeed_requests_running", "Requests in the running batch")
        self.waiting = gauge("tokenspeed_requests_waiting", "Requests waiting to be scheduled")
        self.pages = gauge("tokenspeed_kv_pages_in_use", "KV-cache pages held by requests")
        self.pool = gauge("tokenspeed_kv_pages_total", "KV-cache pages requests may hold (the pool's size)")
        self.ttft = Histogram("tokenspeed_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("tokenspeed_time_per_output_token_seconds",
                              "Mean time between a request's output tokens", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.prompt_tokens = Counter("tokenspeed_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("tokenspeed_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("tokenspeed_requests_finished", "Finished requests", ["finish_reason"],
                                registry=r)

    def admitted(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def engine_ready(self, usable_pages: int) -> None:
        self.pool.set(usable_pages)

    def load(self, load: EngineLoad) -> None:
        """The engine's load after a step."""
        self.running.set(load.running)
        self.waiting.set(load.waiting)
        self.pages.set(load.pages_in_use)

    def finished_group(self, completed: tuple[Completed, ...]) -> None:
        """A prompt's completions, once all have finished."""
        for done in completed:
            self.generation_tokens.inc(done.num_output_tokens)
            self.finished.labels(done.finish_reason).inc()
            if done.time_to_first_token is not None:
                self.ttft.observe(done.time_to_first_token)
            if done.time_per_output_token is not None:
                self.tpot.observe(done.time_per_output_token)

    def text(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.multiprocess_dir)
        return generate_latest(registry)
