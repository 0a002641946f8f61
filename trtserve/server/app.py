"""FastAPI application: thin routes over the engines' services (server/registry.py), OpenAI-shaped errors,
auth, metrics; the KServe v2 routes are in server/kserve.py."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

from starlette.requests import Request

from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, PayloadTooLarge, ServingError, Unauthorized, Unavailable
from trtserve.server.kserve import OPEN as KSERVE_OPEN
from trtserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ErrorBody,
    ErrorResponse,
)

log = logging.getLogger("trtserve.server")
OPEN_PATHS = {"/health", "/metrics"}  # and KServe v2's health probes
PROBE_EVERY = 5.0


def error_response(exc: ServingError, path: str = ""):
    """OpenAI's error shape; the KServe v2 protocol's on its routes."""
    from fastapi.responses import JSONResponse

    from trtserve.server.kserve import error, is_v2

    if is_v2(path):
        return error(exc)
    body = ErrorResponse(error=ErrorBody(message=exc.message, type=exc.type, param=exc.param, code=exc.code))
    headers = {"Retry-After": "1"} if exc.status == 429 else None
    return JSONResponse(body.model_dump(), status_code=exc.status, headers=headers)


def build_app(cfg: ServerConfig, engines: list[tuple[str | None, str]] | None = None):
    """The server for `engines`, (model name or None, engine dir) each; by default cfg.engine_dir."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    from trtserve.server.metrics import Metrics
    from trtserve.server.registry import Registry, plan

    metrics = Metrics()
    configs = plan(cfg, engines)  # a clash of names is an error here, before anything loads
    state = {}

    @asynccontextmanager
    async def lifespan(app):
        registry = Registry(configs, metrics)
        await registry.start()
        state["registry"] = registry
        prober = asyncio.create_task(_probe_forever(registry))
        yield
        prober.cancel()
        await registry.stop()

    app = FastAPI(title="trtserve", lifespan=lifespan)
    app.state.trtserve = state  # the running engines, for hosts that embed the app (Ray Serve replicas)
    app.add_middleware(Guard, cfg=cfg, metrics=metrics, routes=lambda: app.routes)

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
        return error_response(ServingError(str(exc.detail), status=exc.status_code), request.url.path)

    @app.get("/v1/models")
    async def models():
        return state["registry"].models()

    @app.post("/v1/embeddings")
    async def embeddings(request: EmbeddingRequest, raw: Request):
        if request.model_extra:
            log.info("ignoring unknown request fields: %s", sorted(request.model_extra))
        service = state["registry"].get(request.model)
        if service.kind == "decoder":
            raise BadRequest(f"`{service.model_id}` is a decoder engine: it serves /v1/completions and "
                             "/v1/chat/completions; embeddings need an encoder", param="model")
        return await _unless_disconnected(raw, service.embed(request), metrics)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        service = _generator(state["registry"], request)
        jobs = await service.completion_jobs(request)
        return await _answer(raw, service, jobs, request, chat=False, cfg=cfg, metrics=metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        service = _generator(state["registry"], request)
        jobs = await service.chat_jobs(request)
        return await _answer(raw, service, jobs, request, chat=True, cfg=cfg, metrics=metrics)

    @app.get("/health")
    async def health(raw: Request):
        registry = state.get("registry")
        if registry is None:
            return error_response(Unavailable("the server is starting"))
        down = registry.unhealthy(3 * PROBE_EVERY)
        if down:
            named = len(registry) > 1
            return error_response(Unavailable("; ".join(f"`{n}`: {why}" if named else why for n, why in down.items())))
        operator = key_matches(cfg, raw.headers.get("authorization", ""))  # pids and load are for the operator only
        detail = {name: {"kind": s.kind, "ready": True, **({"workers": s.workers()} if operator else {})}
                  for name, s in registry.services.items()}
        body = {"status": "ok", "models": detail}
        if len(detail) == 1:  # one engine: its name and workers at the top, as before several were served
            (name, only), = detail.items()
            body.update({"model": name, **({"workers": only["workers"]} if operator else {})})
        return body

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    from trtserve.server import kserve, tokens

    kserve.register(app, state, cfg, metrics)
    tokens.register(app, state)
    return app


def _explain(errors: list[dict]) -> tuple[str | None, str]:
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


def _generator(registry, request):
    if request.model_extra:
        log.info("ignoring unknown request fields: %s", sorted(request.model_extra))
    service = registry.get(request.model)
    if getattr(service, "kind", "encoder") != "decoder":
        raise BadRequest(f"`{service.model_id}` is an encoder engine: it serves /v1/embeddings, not generation",
                         param="model")
    return service


async def _answer(raw, service, jobs, request, chat: bool, cfg: ServerConfig, metrics):
    from trtserve.server.completions import Deadline, SequenceStream, complete, stream

    deadline = Deadline(cfg.request_timeout)
    submission = service.submit(jobs)  # 429 / 503 here, as real statuses, before any byte is sent
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        # Starlette cancels this generator when the client disconnects; the response closes the sequences
        return SequenceStream(stream(service, jobs, submission, chat, request.model, include_usage, deadline),
                              submission)
    try:
        return await _unless_disconnected(raw, complete(service, jobs, submission, chat, request.model, deadline),
                                          metrics)
    finally:
        submission.close()


async def _unless_disconnected(raw, work, metrics):
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
                return await error_response(rejected, scope["path"])(scope, receive, send_status)
            try:
                await self.app(scope, self._counting(receive), send_status)
            except _TooLarge:
                limit = self.cfg.max_body_bytes
                await error_response(PayloadTooLarge(f"the request body is over the limit of {limit} bytes"),
                                     scope["path"])(scope, receive, send_status)
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
        if scope["path"] not in OPEN_PATHS and scope["path"] not in KSERVE_OPEN:
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


def key_matches(cfg: ServerConfig, authorization: str) -> bool:
    """True when no API key is set, or the Authorization header carries it."""
    if not cfg.api_key:
        return True
    return hmac.compare_digest(authorization.encode("latin-1", "replace"), f"Bearer {cfg.api_key}".encode())


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

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:  %(message)s"))
    logging.getLogger("trtserve").addHandler(handler)
    logging.getLogger("trtserve").setLevel(logging.INFO)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            # uvicorn re-raises a captured signal after its graceful shutdown, which makes the
            # process end "killed by SIGTERM"; a drained shutdown is a normal exit for a service.
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    Server(uvicorn.Config(build_app(cfg, engines), host=cfg.host, port=cfg.port, log_level="info",
                          timeout_graceful_shutdown=cfg.drain_timeout)).run()
