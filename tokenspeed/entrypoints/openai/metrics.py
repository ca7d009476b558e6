"""Prometheus metrics of one server (its own registry: two servers in a process keep
apart): requests running and waiting, KV pages in use, time to first token, time per
output token, and token counters."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, num_pages: int):
        self.registry = CollectorRegistry()
        self.usable_pages = num_pages - 1
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

    def admitted(self, submission) -> None:
        self.prompt_tokens.inc(len(submission.prompt.token_ids) * len(submission.requests))

    def refresh(self, engine) -> None:
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.pages.set(self.usable_pages - scheduler.allocator.num_free)

    def completed(self, request) -> None:
        """Called once per finished completion (from the loop's thread)."""
        self.generation_tokens.inc(len(request.output))
        self.finished.labels(request.finish_reason or "abort").inc()
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - request.arrival_time)
            if len(request.output) > 1 and request.finish_time is not None:
                self.tpot.observe((request.finish_time - request.first_token_time) / (len(request.output) - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)
