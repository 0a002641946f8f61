"""What every route module shares: the server's state on the app, error bodies in each protocol's shape,
the probe period, open paths, the API key check, and cancelling work when its client goes away. It
imports no route module, so the routers (server/openai_routes.py, kserve.py, tokens.py) and app.py
depend on it and never on each other."""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trtserve.server.config import ServerConfig
from trtserve.server.errors import ServingError, Unavailable
from trtserve.server.protocol import ErrorBody, ErrorResponse

if TYPE_CHECKING:
    from trtserve.server.metrics import Metrics
    from trtserve.server.registry import Registry

log = logging.getLogger("trtserve.server")
PROBE_EVERY = 5.0  # seconds between health probes of every engine; /health fails after three missed
V2_PREFIX = "/v2"
OPEN_PATHS = {"/health", "/metrics", "/v2/health/live", "/v2/health/ready"}  # no API key: probes and scrapes


@dataclass
class Serving:
    """One server's state, on `app.state.serving`: its options, its metrics, and the engines (the registry,
    None until the lifespan has started them)."""

    cfg: ServerConfig
    metrics: Metrics
    registry: Registry | None = None

    def engines(self):
        if self.registry is None:
            raise Unavailable("the server is starting")
        return self.registry


def serving(raw) -> Serving:
    """The state of the server a request (starlette Request) came to."""
    return raw.app.state.serving


def is_v2(path: str) -> bool:
    return path == V2_PREFIX or path.startswith(V2_PREFIX + "/")


def v2_error(exc: ServingError):
    """The KServe v2 protocol's error body: {"error": message}."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": exc.message}, status_code=exc.status)


def route_path(scope) -> str:
    """The request's path as the routes see it: without the --root-path prefix that the server adds to it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def error_response(exc: ServingError, path: str = ""):
    """OpenAI's error shape; the KServe v2 protocol's on its routes."""
    from fastapi.responses import JSONResponse

    if is_v2(path):
        return v2_error(exc)
    body = ErrorResponse(error=ErrorBody(message=exc.message, type=exc.type, param=exc.param, code=exc.code))
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


def key_matches(cfg: ServerConfig, authorization: str) -> bool:
    """True when no API key is set, or the Authorization header carries it."""
    if not cfg.api_key:
        return True
    return hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {cfg.api_key}".encode())


async def unless_disconnected(raw, work, metrics):
    """Await `work` unless the client disconnects first; then cancel it, which drops its queued rows."""
    from fastapi.responses import Response

    work = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work in done:
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    metrics.disconnects.inc()
    log.info("client disconnected; its queued work was dropped")
    return Response(status_code=499)  # nobody reads it; nginx's code for "client closed request"


async def _disconnected(raw) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass
