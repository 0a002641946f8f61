"""Server configuration: one frozen settings model; every field is a `serve` flag and a TRTSERVE_* variable."""

from __future__ import annotations

from pydantic import Field

from trtserve.settings import Settings


class ServerConfig(Settings):
    """What `trtserve serve` runs with. Every field but engine_dir is a `serve` flag and a TRTSERVE_*
    variable (trtserve/settings.py); the CLI, its --help and the checks are generated from here."""

    engine_dir: str = Field(description="the engine directory served")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=1, le=65535, description="port to listen on")
    workers: int | None = Field(None, ge=0, description="worker processes, each owning a backend (default: one "
                                "per GPU, else 1; 0 runs the backend inside the server process)")
    max_batch: int = Field(32, ge=1, description="rows per batch")
    max_batch_tokens: int = Field(16384, ge=1, description="padded tokens per batch, rows x longest row (decoders: "
                                  "per prefill of newcomers; at least the engine's max sequence)")
    max_num_seqs: int = Field(16, ge=1, description="decoders: sequences in the running batch (continuous batching)")
    max_prefill_tokens: int = Field(128, ge=0, description="decoders: padded prompt tokens prefilled per step, in "
                                    "chunks between decode steps so newcomers do not stall running streams (0: each "
                                    "prefill in one call)")
    prefix_cache_mib: int = Field(256, ge=0, description="decoders: MiB per worker for the KV rows of prompt "
                                  "prefixes reused across requests (automatic prefix caching; engines with a decode "
                                  "graph); 0 turns it off")
    max_n: int = Field(8, ge=1, description="decoders: the largest `n` (choices per request) accepted")
    max_wait_ms: float = Field(5.0, ge=0, description="longest wait to fill a batch")
    max_queue: int = Field(256, ge=1, description="encoders: rows waiting at most; decoders: sequences waiting per "
                           "worker; beyond it requests get 429, and a request with more inputs (prompts x n) gets 400")
    max_queue_tokens: int = Field(65536, ge=1, description="decoders: prompt tokens a worker holds, running and "
                                  "waiting; beyond it 429, and a request with more gets 400")
    api_key: str | None = Field(None, description="require `Authorization: Bearer KEY`")
    request_timeout: float = Field(60.0, ge=0, description="seconds before a request gets 504 (a stream: an error "
                                   "event)")
    worker_timeout: float = Field(120.0, gt=0, description="seconds one batch or generation step may take; a worker "
                                  "that misses it (hung, stopped) is killed and restarted and its requests get 503")
    heartbeat_timeout: float = Field(10.0, gt=0, description="seconds a worker process may go without a heartbeat "
                                     "(it beats every second from a thread of its own, busy or not); one that "
                                     "misses it (stopped, or stuck holding the interpreter) is killed and restarted "
                                     "and its requests get 503")
    drain_timeout: float = Field(30.0, ge=0, description="on SIGTERM, seconds to finish in-flight requests before "
                                 "exiting")
    max_body_bytes: int = Field(2 * 1024 * 1024, ge=1, description="largest request body accepted (413 beyond it)")
    served_model_name: str | None = Field(None, description="model name clients use (default: the engine's model "
                                          "id)")
    threads: int | None = Field(None, gt=0, description="CPU threads per worker (default: the cores divided among "
                                "the workers)")
    tracks: int | None = Field(None, gt=0, description="track-sharded engines: rank processes sharing the tracks, "
                               "all-reducing at segment boundaries, under the one worker that batches their "
                               "sequences (default: one per track)")


def placement(workers: int | None, threads: int | None = None) -> tuple[int, list[int | None], int | None, str]:
    """(worker count, device per worker slot, CPU threads per worker, why) for this machine."""
    from trtserve.runtime.base import available_cores
    from trtserve.runtime.devices import cuda_devices

    gpus, reason = cuda_devices()
    if gpus:
        count = gpus if workers is None else workers
        return count, list(range(gpus)), None, f"{gpus} CUDA device(s): worker i runs on GPU i mod {gpus}"
    count = 1 if workers is None else workers
    threads = threads or max(1, available_cores() // max(count, 1))
    where = "in the server process" if count == 0 else f"{count} process(es)"
    return count, [None], threads, f"{reason}; CPU workers {where}, {threads} thread(s) each"
