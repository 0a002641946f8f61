"""Prometheus metrics of one server (its own registry, so several apps can share a process). HTTP
metrics are the server's; the rest carry a `model` label, one series per engine served
(`Metrics.of(name)` is that engine's view)."""

from __future__ import annotations

SERVER_WIDE = ("registry", "requests", "latency", "disconnects")


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        engine = {"labelnames": ["model"], "registry": self.registry}  # per-engine series
        fast = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.requests = Counter("trtserve_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.queue_size = Gauge("trtserve_queue_size", "rows waiting for a batch", **engine)
        self.queue_time = Histogram("trtserve_queue_seconds", "time a row waited in the queue",
                                    buckets=fast, **engine)
        self.batch_size = Histogram("trtserve_batch_size", "rows per batch run by the backend",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), **engine)
        self.inference_time = Histogram("trtserve_inference_seconds", "backend time per batch",
                                        buckets=fast, **engine)
        self.dropped_rows = Counter("trtserve_dropped_rows", "queued rows dropped because their caller "
                                    "timed out or disconnected", **engine)
        self.disconnects = Counter("trtserve_client_disconnects", "requests whose client went away before "
                                   "the answer", registry=self.registry)
        self.workers_ready = Gauge("trtserve_workers_ready", "workers ready to take batches", **engine)
        self.worker_restarts = Counter("trtserve_worker_restarts", "worker processes restarted after dying",
                                       **engine)
        slow = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.ttft = Histogram("trtserve_time_to_first_token_seconds", "time from request to first token",
                              buckets=slow, **engine)
        self.tpot = Histogram("trtserve_time_per_output_token_seconds", "request time divided by its output tokens",
                              buckets=slow, **engine)
        self.itl = Histogram("trtserve_inter_token_latency_seconds", "time between two tokens of a sequence",
                             buckets=slow, **engine)
        self.generated_tokens = Counter("trtserve_generated_tokens", "tokens generated", **engine)
        self.prefix_queries = Counter("trtserve_prefix_cache_queries", "prompt tokens looked up in the workers' "
                                      "prefix caches", **engine)
        self.prefix_hits = Counter("trtserve_prefix_cache_hits", "prompt tokens whose KV rows came from a prefix "
                                   "cache instead of a prefill", **engine)
        self.running_seqs = Gauge("trtserve_running_sequences", "sequences being generated", **engine)
        self.waiting_seqs = Gauge("trtserve_waiting_sequences", "sequences waiting to join the running batch",
                                  **engine)
        self.latency = Histogram("trtserve_request_seconds", "end-to-end request latency",
                                 ["route"], buckets=fast, registry=self.registry)

    def of(self, model: str) -> ModelMetrics:
        """`model`'s series, every one on /metrics from now on (at 0), as unlabelled ones would be."""
        view = ModelMetrics(self, model)
        for name, metric in vars(self).items():
            if name not in SERVER_WIDE:
                metric.labels(model=model)
        return view

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class ModelMetrics:
    """One engine's series: the same attributes as Metrics, each bound to `model=<name>`."""

    def __init__(self, metrics: Metrics, model: str):
        self._metrics, self.model = metrics, model

    def __getattr__(self, name: str):
        metric = getattr(self._metrics, name)
        return metric if name in SERVER_WIDE else metric.labels(model=self.model)

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
