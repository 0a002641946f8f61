"""FastAPI application: thin routes over EmbeddingService, OpenAI-shaped errors, auth, metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, PayloadTooLarge, ServingError, Unauthorized, Unavailable
from trtserve.server.protocol import EmbeddingRequest, ErrorBody, ErrorResponse

log = logging.getLogger("trtserve.server")
OPEN_PATHS = {"/health", "/metrics"}
PROBE_EVERY = 5.0


def error_response(exc: ServingError):
    from fastapi.responses import JSONResponse

    body = ErrorResponse(error=ErrorBody(message=exc.message, type=exc.type, param=exc.param, code=exc.code))
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


def build_app(cfg: ServerConfig):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    from trtserve.server.metrics import Metrics
    from trtserve.server.serving import EmbeddingService

    metrics = Metrics()
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        service = EmbeddingService(cfg, metrics)
        await service.start()
        state["service"] = service
        prober = asyncio.create_task(_probe_forever(service))
        log.info("serving %s from %s", service.model_id, cfg.engine_dir)
        yield
        prober.cancel()
        await service.stop()

    app = FastAPI(title="trtserve", lifespan=lifespan)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        started = time.perf_counter()
        response = await _guarded(request, call_next)
        route = request.url.path
        metrics.requests.labels(route=route, status=str(response.status_code)).inc()
        metrics.latency.labels(route=route).observe(time.perf_counter() - started)
        return response

    async def _guarded(request: Request, call_next):
        if request.url.path not in OPEN_PATHS and cfg.api_key:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                return error_response(Unauthorized("invalid or missing API key: send `Authorization: Bearer <key>`",
                                                   code="invalid_api_key"))
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > cfg.max_body_bytes:
            return error_response(
                PayloadTooLarge(f"the request body has {size} bytes; the limit is {cfg.max_body_bytes}"))
        return await call_next(request)

    @app.exception_handler(ServingError)
    async def serving_error(request, exc: ServingError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return error_response(BadRequest(f"the body is not valid JSON ({first.get('ctx', {}).get('error', '')})"))
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        message = f"{where}: {first.get('msg')}" if where else str(first.get("msg", "invalid request"))
        return error_response(BadRequest(message, param=where))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error_response(ServingError(str(exc.detail), status=exc.status_code))

    @app.get("/v1/models")
    async def models():
        return state["service"].models()

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest):
        if request.model_extra:
            log.info("ignoring unknown request fields: %s", sorted(request.model_extra))
        return await state["service"].embed(request)

    @app.get("/health")
    async def health():
        service = state.get("service")
        if service is None or time.monotonic() - service.last_probe_ok > 3 * PROBE_EVERY:
            return error_response(Unavailable("the backend has not answered a probe recently"))
        return {"status": "ok", "model": service.model_id}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


async def _probe_forever(service) -> None:
    while True:
        await asyncio.sleep(PROBE_EVERY)
        try:
            await service.probe()
        except Exception:  # a failed probe leaves last_probe_ok stale: /health turns 503
            log.exception("health probe failed")


def serve(cfg: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, then finish in-flight requests and return (exit code 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # uvicorn re-raises a captured signal after its graceful shutdown, which makes the
            # process end "killed by SIGTERM"; a drained shutdown is a normal exit for a service.
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    Server(uvicorn.Config(build_app(cfg), host=cfg.host, port=cfg.port, log_level="info")).run()
