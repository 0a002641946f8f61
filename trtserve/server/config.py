"""Server configuration: a frozen dataclass; every field is a `serve` flag and a TRTSERVE_* variable."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    engine_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int | None = None  # None: one per GPU, else one; 0: run the backend in the server process
    max_batch: int = 32
    max_batch_tokens: int = 16384  # padded tokens per batch (rows x longest row); decoders: per prefill
    max_num_seqs: int = 16  # decoders: sequences in the running batch
    max_prefill_tokens: int = 256  # decoders: padded prompt tokens prefilled per step (chunks); 0: whole prompts
    max_n: int = 8  # decoders: largest `n` a request may ask for
    max_wait_ms: float = 5.0
    max_queue: int = 256  # encoders: rows waiting; decoders: sequences waiting per worker
    max_queue_tokens: int = 65536  # decoders: prompt tokens a worker holds, running and waiting
    api_key: str | None = None
    request_timeout: float = 60.0
    worker_timeout: float = 120.0  # seconds one batch or generation step may take before its worker is replaced
    drain_timeout: float = 30.0
    max_body_bytes: int = 2 * 1024 * 1024
    served_model_name: str | None = None
    threads: int | None = None  # CPU threads per worker (None: the cores divided among the workers)
    tracks: int | None = None  # track-sharded engines: worker processes sharing the tracks (None: one per track)


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
