"""FastAPI application: the server's state, its lifespan (engines started and probed), OpenAI-shaped
errors, and the Guard middleware (API key, body limit, request metrics). The routes are module-level
routers: server/openai_routes.py (OpenAI, /health, /metrics), kserve.py (KServe v2), tokens.py,
rerank_routes.py (cross-encoders)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager

from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, PayloadTooLarge, ServingError, Unauthorized
from trtserve.server.http import OPEN_PATHS, PROBE_EVERY, Serving, error_response, key_matches, route_path

log = logging.getLogger("trtserve.server")


def build_app(cfg: ServerConfig, engines: list[tuple[str | None, str]] | None = None):
    """The server for `engines`, (model name or None, engine dir) each; by default cfg.engine_dir."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from trtserve.server import kserve, openai_routes, rerank_routes, tokens
    from trtserve.server.metrics import Metrics
    from trtserve.server.registry import Registry, plan

    metrics = Metrics()
    configs = plan(cfg, engines)  # a clash of names is an error here, before anything loads
    state = Serving(cfg, metrics)

    @asynccontextmanager
    async def lifespan(app):
        registry = Registry(configs, metrics)
        await registry.start()
        state.registry = registry
        prober = asyncio.create_task(_probe_forever(registry))
        yield
        prober.cancel()
        await registry.stop()

    app = FastAPI(title="trtserve", lifespan=lifespan)
    app.state.serving = state  # the routes' state, and the running engines for hosts that embed the app (Ray)
    routers = (openai_routes.router, kserve.router, tokens.router, rerank_routes.router)

    def templates():  # every route with its path template (an included router is one opaque entry of app.routes)
        return [r for r in app.routes if hasattr(r, "path")] + [r for router in routers for r in router.routes]

    app.add_middleware(Guard, cfg=cfg, metrics=metrics, routes=templates)
    if cfg.allowed_origins:  # outermost: a browser's preflight is answered before the API key check
        from starlette.middleware.cors import CORSMiddleware

        origins = [o.strip() for o in cfg.allowed_origins.split(",") if o.strip()]
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])

    @app.exception_handler(ServingError)
    async def serving_error(request, exc: ServingError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_response(BadRequest(f"the body is not valid JSON ({first.get('ctx', {}).get('error', '')})"))
        where, message = _explain(errors)
        return error_response(BadRequest(f"{where}: {message}" if where else message, param=where))

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error_response(ServingError(str(exc.detail), status=exc.status_code), route_path(request.scope))

    for router in routers:
        app.include_router(router)
    return app


def _explain(errors: Sequence[dict]) -> tuple[str | None, str]:
    """(field path, message) of pydantic's errors: of a union's branches, the one that got deepest
    into the value; where they all stop at the same place, what each branch expected."""
    if not errors:
        return None, "invalid request"

    def path(error) -> list:
        # drop "body" and the names pydantic gives union branches ("list[constrained-int]", ...)
        return [p for p in error.get("loc", ()) if isinstance(p, int) or (p != "body" and p.isidentifier())]

    deepest = max(len(path(e)) for e in errors)
    best = [e for e in errors if len(path(e)) == deepest]
    specific = [e for e in best if not e.get("type", "").endswith("_type")]
    chosen = specific[:1] or best
    where = ".".join(str(p) for p in path(chosen[0])) or None
    return where, " or ".join(dict.fromkeys(str(e.get("msg", "invalid")) for e in chosen))


class Guard:
    """ASGI middleware (not BaseHTTPMiddleware, which costs a task per request and hides disconnects):
    API key, body size limit (Content-Length or counted while streaming), request metrics."""

    def __init__(self, app, cfg: ServerConfig, metrics, routes=lambda: []):
        self.app, self.cfg, self.metrics, self.routes = app, cfg, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, route, status = time.perf_counter(), self._template(scope), [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            rejected = self._reject(scope)
            if rejected is not None:
                return await error_response(rejected, route_path(scope))(scope, receive, send_status)
            try:
                await self.app(scope, self._counting(receive), send_status)
            except _TooLarge:
                limit = self.cfg.max_body_bytes
                await error_response(PayloadTooLarge(f"the request body is over the limit of {limit} bytes"),
                                     route_path(scope))(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(route=route, status=str(status[0])).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - started)

    def _template(self, scope) -> str:
        """The route's path template as the metrics label: a client cannot mint new label values."""
        from starlette.routing import Match

        for route in self.routes():
            if route.matches(scope)[0] != Match.NONE:
                return getattr(route, "path", "unmatched")
        return "unmatched"

    def _reject(self, scope) -> ServingError | None:
        headers = dict(scope["headers"])
        if route_path(scope) not in OPEN_PATHS:
            if not key_matches(self.cfg, headers.get(b"authorization", b"").decode("latin-1")):
                return Unauthorized("invalid or missing API key: send `Authorization: Bearer <key>`",
                                    code="invalid_api_key")
        size = headers.get(b"content-length", b"")
        if size.isdigit() and int(size) > self.cfg.max_body_bytes:
            return PayloadTooLarge(f"the request body has {int(size)} bytes; the limit is {self.cfg.max_body_bytes}")
        return None

    def _counting(self, receive):
        seen = [0]

        async def counted():
            message = await receive()
            seen[0] += len(message.get("body", b""))
            if seen[0] > self.cfg.max_body_bytes:
                raise _TooLarge
            return message

        return counted


class _TooLarge(BaseException):
    """A BaseException so that the framework's body parser, which turns any Exception into a 400,
    lets it through to Guard, which answers 413."""


async def _probe_forever(service) -> None:
    while True:
        await asyncio.sleep(PROBE_EVERY)
        try:
            await service.probe()
        except Exception:  # a failed probe leaves last_probe_ok stale: /health turns 503
            log.exception("health probe failed")


def serve(cfg: ServerConfig, engines: list[tuple[str | None, str]] | None = None) -> None:
    """Serve `engines` (see build_app). Run until SIGTERM/SIGINT, then finish in-flight requests and
    return (exit code 0)."""
    import uvicorn

    handler = logging.StreamHandler()  # trtserve's and uvicorn's lines alike, each with its time
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("trtserve", "uvicorn"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(cfg.log_level.upper())
    logging.getLogger("uvicorn.access").disabled = cfg.disable_uvicorn_access_log

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # uvicorn re-raises a captured signal after its graceful shutdown, which makes the
            # process end "killed by SIGTERM"; a drained shutdown is a normal exit for a service.
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    Server(uvicorn.Config(build_app(cfg, engines), host=cfg.host, port=cfg.port, log_config=None,
                          log_level=cfg.log_level, access_log=not cfg.disable_uvicorn_access_log,
                          root_path=cfg.root_path or "",
                          ssl_keyfile=cfg.ssl_keyfile, ssl_certfile=cfg.ssl_certfile,
                          # uvicorn annotates an int but passes it to asyncio.wait_for: a float works
                          timeout_graceful_shutdown=cfg.drain_timeout)).run()  # type: ignore[arg-type]
