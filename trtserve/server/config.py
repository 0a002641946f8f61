"""Server configuration: one frozen settings model; every field is a `serve` flag and a TRTSERVE_* variable."""

from __future__ import annotations

from typing import Literal

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
    max_num_seqs: int = Field(32, ge=1, description="decoders: sequences in the running batch (continuous batching; "
                              "at most the engine's --max-batch)")
    max_prefill_tokens: int = Field(256, ge=0, description="decoders: padded prompt tokens prefilled per step, in "
                                    "chunks between decode steps so newcomers do not stall running streams (0: each "
                                    "prefill in one call)")
    prefix_cache_mib: int = Field(256, ge=0, description="decoders: MiB per worker for the KV rows of prompt "
                                  "prefixes reused across requests (automatic prefix caching; engines with a decode "
                                  "graph); 0 turns it off")
    max_n: int = Field(8, ge=1, description="decoders: the largest `n` (choices per request) accepted")
    tool_call_parser: Literal["auto", "json", "hermes", "llama3_json", "mistral"] = Field(
        "auto", description="decoders: the form tool calls are read in under tool_choice auto (auto: from the chat "
        "template's markers; json is the whole answer as {name, arguments})")
    chat_template: str | None = Field(None, description="decoders: a chat template (a file's path, or the Jinja "
                                      "text itself) used instead of the tokenizer's")
    generation_config: Literal["auto", "none"] = Field("auto", description="decoders: `auto` takes the sampling "
                                                     "defaults (temperature, top_p, top_k, min_p, repetition_penalty) "
                                                     "a request leaves out from the engine's generation_config.json, "
                                                     "as vLLM does; `none` keeps OpenAI's defaults")
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
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="the server's log level (trtserve's and uvicorn's lines, each with a timestamp)")
    disable_uvicorn_access_log: bool = Field(False, description="leave out uvicorn's line per request")
    allowed_origins: str | None = Field(None, description="CORS: origins browsers may call from, comma-separated "
                                        "(* for any); none by default")
    root_path: str | None = Field(None, description="the path prefix a proxy serves this server under (ASGI "
                                  "root_path: links and the OpenAPI page carry it)")
    ssl_keyfile: str | None = Field(None, description="serve HTTPS with this private key (PEM; with --ssl-certfile)")
    ssl_certfile: str | None = Field(None, description="serve HTTPS with this certificate chain (PEM; with "
                                     "--ssl-keyfile)")
    tracks: int | None = Field(None, gt=0, description="track-sharded engines: rank processes sharing the tracks, "
                               "all-reducing at segment boundaries, under the one worker that batches their "
                               "sequences (default: one per track)")


def check_tls(cfg: ServerConfig) -> None:
    """HTTPS needs both the key and the certificate, each a readable file."""
    from pathlib import Path

    from trtserve.errors import TrtServeError

    given = {name: getattr(cfg, name) for name in ("ssl_keyfile", "ssl_certfile") if getattr(cfg, name)}
    if len(given) == 1:
        (name, _), = given.items()
        other = "--ssl-certfile" if name == "ssl_keyfile" else "--ssl-keyfile"
        raise TrtServeError(f"--{name.replace('_', '-')} needs {other} too: HTTPS takes both")
    for name, path in given.items():
        if not Path(path).is_file():
            raise TrtServeError(f"--{name.replace('_', '-')} {path} is not a readable file")


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
