"""Prometheus metrics of one server (its own registry: two servers in a process keep
apart): requests running and waiting, KV pages in use, time to first token, time per
output token, and token counters."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenspeed.entrypoints.engine_loop import StepReport

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("tokenspeed_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("tokenspeed_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.pages = Gauge("tokenspeed_kv_pages_in_use", "KV-cache pages held by requests", registry=r)
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

    def observe(self, report: StepReport) -> None:
        """The engine's load after a step and the completions that finished in it."""
        self.running.set(report.load.running)
        self.waiting.set(report.load.waiting)
        self.pages.set(report.load.pages_in_use)
        for done in report.completed:
            self.generation_tokens.inc(done.num_output_tokens)
            self.finished.labels(done.finish_reason).inc()
            if done.time_to_first_token is not None:
                self.ttft.observe(done.time_to_first_token)
            if done.time_per_output_token is not None:
                self.tpot.observe(done.time_per_output_token)

    def text(self) -> bytes:
        return generate_latest(self.registry)
