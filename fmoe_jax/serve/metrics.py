"""fmoe-serve's Prometheus metrics (`GET /metrics`), in a registry of the server's own (nothing global).

The HTTP layer counts requests and observes TTFT / TPOT per request; the scheduler reports each busy period's
`GenerationStats` (expert hits and misses, bytes copied to the device, compile time) through `batch_done`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

import fmoe_jax as fj

# Seconds; TTFT includes the time a request waited in the queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """The server's metrics. `queue_depth` and `running` are read from the scheduler when scraped."""

    def __init__(
        self, queue_depth: Callable[[], int], running: Callable[[], int], compilations: Callable[[], int]
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "fmoe_requests",
            "Requests answered, by route and status (an HTTP code, or 'cancelled': the client went away)",
            ["route", "status"],
            registry=r,
        )
        Gauge("fmoe_queue_depth", "Requests waiting to run", registry=r).set_function(queue_depth)
        Gauge("fmoe_running_requests", "Requests now running", registry=r).set_function(running)
        Gauge(
            "fmoe_compilations",
            "Programs the model has compiled since it was loaded (constant while serving after --warmup)",
            registry=r,
        ).set_function(compilations)
        self.ttft = Histogram(
            "fmoe_time_to_first_token_seconds",
            "From a request's arrival (queueing included) to its first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "fmoe_time_per_output_token_seconds",
            "Mean time per token after the first, per request",
            buckets=TPOT_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("fmoe_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generated_tokens = Counter("fmoe_generation_tokens", "Tokens generated and sent", registry=r)
        self.hits = Counter("fmoe_expert_hits", "Needed experts that were on the device", registry=r)
        self.misses = Counter("fmoe_expert_misses", "Needed experts that were not on the device", registry=r)
        self.hit_rate = Gauge("fmoe_expert_hit_rate", "hits / (hits + misses) since start", registry=r)
        self.hit_rate.set(1.0)
        self._hits_misses = [0, 0]  # the counters' totals, for the rate (only the scheduler thread writes)
        self.bytes_to_device = Counter(
            "fmoe_bytes_to_device", "Bytes of expert weights copied to the device", registry=r
        )
        self.host_computed = Counter(
            "fmoe_host_computed_experts", "Misses computed on the host (hybrid execution)", registry=r
        )
        self.compile_seconds = Counter(
            "fmoe_compile_seconds", "Seconds spent compiling programs while serving requests", registry=r
        )
        self.batches = Counter(
            "fmoe_batches",
            "Busy periods served: a request run alone, or a continuous batch from its first request to idle",
            registry=r,
        )
        self.decode_steps = Counter(
            "fmoe_decode_steps",
            "Continuous batch decode steps, by the rows decoding in them",
            ["rows"],
            registry=r,
        )

    def batch_done(self, stats: fj.GenerationStats) -> None:
        """Called by the scheduler thread with each finished batch's statistics."""
        self.batches.inc()
        self.hits.inc(stats.hits)
        self.misses.inc(stats.misses)
        self._hits_misses[0] += stats.hits
        self._hits_misses[1] += stats.misses
        hits, misses = self._hits_misses
        self.hit_rate.set(hits / (hits + misses) if hits + misses else 1.0)
        self.bytes_to_device.inc(stats.bytes_to_device)
        self.host_computed.inc(stats.host_computed)
        self.compile_seconds.inc(stats.compile_s)
        for rows in stats.extra.get("decode_rows", ()):
            self.decode_steps.labels(str(rows)).inc()

    def request_done(self, route: str, status: int | str) -> None:
        self.requests.labels(route, str(status)).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format."""
        return generate_latest(self.registry)
