"""Prometheus metrics of one server (its own registry, so several apps can share a process)."""

from __future__ import annotations


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        fast = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.requests = Counter("trtserve_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.queue_size = Gauge("trtserve_queue_size", "rows waiting for a batch", registry=self.registry)
        self.queue_time = Histogram("trtserve_queue_seconds", "time a row waited in the queue",
                                    buckets=fast, registry=self.registry)
        self.batch_size = Histogram("trtserve_batch_size", "rows per batch run by the backend",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.inference_time = Histogram("trtserve_inference_seconds", "backend time per batch",
                                        buckets=fast, registry=self.registry)
        self.dropped_rows = Counter("trtserve_dropped_rows", "queued rows dropped because their caller "
                                    "timed out or disconnected", registry=self.registry)
        self.disconnects = Counter("trtserve_client_disconnects", "requests whose client went away before "
                                   "the answer", registry=self.registry)
        self.workers_ready = Gauge("trtserve_workers_ready", "workers ready to take batches", registry=self.registry)
        self.worker_restarts = Counter("trtserve_worker_restarts", "worker processes restarted after dying",
                                       registry=self.registry)
        slow = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("trtserve_time_to_first_token_seconds", "time from request to first token",
                              buckets=slow, registry=self.registry)
        self.tpot = Histogram("trtserve_time_per_output_token_seconds", "request time divided by its output tokens",
                              buckets=slow, registry=self.registry)
        self.itl = Histogram("trtserve_inter_token_latency_seconds", "time between two tokens of a sequence",
                             buckets=slow, registry=self.registry)
        self.generated_tokens = Counter("trtserve_generated_tokens", "tokens generated", registry=self.registry)
        self.running_seqs = Gauge("trtserve_running_sequences", "sequences being generated", registry=self.registry)
        self.waiting_seqs = Gauge("trtserve_waiting_sequences", "sequences waiting to join the running batch",
                                  registry=self.registry)
        self.latency = Histogram("trtserve_request_seconds", "end-to-end request latency",
                                 ["route"], buckets=fast, registry=self.registry)

    def observe(self, name: str, value: float) -> None:
        metric = getattr(self, name)
        if name == "queue_size":
            metric.set(value)
        elif name == "dropped_rows":
            metric.inc(value)
        else:
            metric.observe(value)

    def observe_generation(self, name: str, value: float) -> None:
        if name == "tokens":
            self.generated_tokens.inc(value)
        else:
            getattr(self, name).observe(value)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
