"""Server configuration: a frozen dataclass; every field is a `serve` flag and a TRTSERVE_* variable."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    engine_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 32
    max_wait_ms: float = 5.0
    max_queue: int = 256
    api_key: str | None = None
    request_timeout: float = 60.0
    max_body_bytes: int = 2 * 1024 * 1024
    served_model_name: str | None = None
