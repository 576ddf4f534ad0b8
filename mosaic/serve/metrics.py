"""Prometheus metrics of one server (its own registry, so several apps can live in a process).

Exposed at /metrics: queue length, device memory by part (engine.memory_report(), read at
scrape time), tokens and seconds (rate() of the counters = throughput), the last request's
tokens/s, refusals by reason, requests by endpoint and HTTP status, cancellations, and latency
histograms of the queue wait, the engine run and the server's own overhead."""

from __future__ import annotations

import resource

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class MemoryCollector:
    """mosaic_device_memory_bytes{part=...} from engine.memory_report() at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        g = GaugeMetricFamily("mosaic_device_memory_bytes", "Device memory by part (bytes)", labels=["part"])
        rep = self.engine.memory_report()
        for key, value in rep.items():
            if key.endswith("_bytes") and isinstance(value, int):
                g.add_metric([key[: -len("_bytes")]], value)
        if self.engine.model.device.type != "cuda":   # CPU: the process is the device
            g.add_metric(["process_peak_rss"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        yield g


class Metrics:
    def __init__(self, engine, queue_length):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("mosaic_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.refusals = Counter("mosaic_refusals", "Requests refused at admission (HTTP 400 context_length_exceeded) "
                                "by reason", ["reason"], registry=r)
        self.cancelled = Counter("mosaic_cancelled", "Requests stopped because the client went away", registry=r)
        self.finished = Counter("mosaic_finished", "Requests run to the end by finish reason", ["reason"], registry=r)
        self.canvas_tokens = Counter("mosaic_canvas_tokens", "Canvas tokens denoised (max_tokens of each request)",
                                     registry=r)
        self.completion_tokens = Counter("mosaic_completion_tokens", "Tokens returned (before end-of-text)",
                                         registry=r)
        self.prompt_tokens = Counter("mosaic_prompt_tokens", "Prompt tokens", registry=r)
        self.steps = Counter("mosaic_denoising_steps", "Denoising steps run", registry=r)
        self.engine_seconds_total = Counter("mosaic_engine_seconds", "Seconds the engine spent generating",
                                            registry=r)
        self.tokens_per_second = Gauge("mosaic_tokens_per_second",
                                       "Canvas tokens per second of the last finished request", registry=r)
        self.queue_wait = Histogram("mosaic_queue_wait_seconds", "Wait in the queue", buckets=BUCKETS, registry=r)
        self.engine_time = Histogram("mosaic_engine_time_seconds", "Engine time per request", buckets=BUCKETS,
                                     registry=r)
        self.overhead = Histogram("mosaic_server_overhead_seconds",
                                  "Server time per request outside the queue and the engine", buckets=BUCKETS,
                                  registry=r)
        queue = Gauge("mosaic_queue_length", "Requests waiting or running", registry=r)
        queue.set_function(queue_length)
        r.register(MemoryCollector(engine))

    def job_done(self, result) -> None:
        self.finished.labels(result.finish_reason).inc()
        self.canvas_tokens.inc(result.canvas_tokens)
        self.completion_tokens.inc(result.completion_tokens)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.steps.inc(result.steps_run)
        self.engine_seconds_total.inc(result.engine_seconds)
        self.engine_time.observe(result.engine_seconds)
        self.queue_wait.observe(result.queue_seconds)
        if result.engine_seconds > 0:
            self.tokens_per_second.set(result.canvas_tokens / result.engine_seconds)
