"""The OpenAI-compatible routes, /health and /metrics: thin handlers over the engines' services
(server/registry.py), the server's state read from the app (server/http.py)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from starlette.requests import Request

from trtserve.engine_dir.kinds import ModelKind
from trtserve.server.errors import BadRequest, Unavailable
from trtserve.server.http import PROBE_EVERY, error_response, key_matches, log, serving, unless_disconnected
from trtserve.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ModelList

router = APIRouter()


@router.get("/v1/models")
async def models(raw: Request) -> ModelList:
    return serving(raw).engines().models()


@router.post("/v1/embeddings")
async def embeddings(request: EmbeddingRequest, raw: Request):
    if request.model_extra:
        log.info("ignoring unknown request fields: %s", sorted(request.model_extra))
    state = serving(raw)
    service = state.engines().get(request.model)
    if service.kind == ModelKind.DECODER:
        raise BadRequest(f"`{service.model_id}` is a decoder engine: it serves /v1/completions and "
                         "/v1/chat/completions; embeddings need an encoder", param="model")
    if service.kind == ModelKind.SCORER:
        raise BadRequest(f"`{service.model_id}` is a cross-encoder: it scores pairs on /v1/rerank, /rerank and "
                         "/v1/score; embeddings need an encoder", param="model")
    return await unless_disconnected(raw, service.embed(request), state.metrics)


@router.post("/v1/completions")
async def completions(request: CompletionRequest, raw: Request):
    service = _generator(serving(raw).engines(), request)
    jobs = await service.completion_jobs(request)
    return await _answer(raw, service, jobs, request, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: ChatCompletionRequest, raw: Request):
    service = _generator(serving(raw).engines(), request)
    jobs = await service.chat_jobs(request)
    return await _answer(raw, service, jobs, request, chat=True)


@router.get("/health")
async def health(raw: Request):
    state = serving(raw)
    registry = state.registry
    if registry is None:
        return error_response(Unavailable("the server is starting"))
    down = registry.unhealthy(3 * PROBE_EVERY)
    if down:
        named = len(registry) > 1
        return error_response(Unavailable("; ".join(f"`{n}`: {why}" if named else why for n, why in down.items())))
    operator = key_matches(state.cfg, raw.headers.get("authorization", ""))  # pids and load are for the operator only
    detail = {name: {"kind": s.kind, "ready": True, **({"workers": s.workers()} if operator else {})}
              for name, s in registry.services.items()}
    body = {"status": "ok", "models": detail}
    if len(detail) == 1:  # one engine: its name and workers at the top, as before several were served
        (name, only), = detail.items()
        body.update({"model": name, **({"workers": only["workers"]} if operator else {})})
    return body


@router.get("/metrics")
async def prometheus(raw: Request):
    body, content_type = serving(raw).metrics.render()
    return Response(body, media_type=content_type)


def _generator(registry, request):
    from trtserve.server.unserved import UNSERVED, refuse_unserved

    refuse_unserved(request)  # a known field this server does not apply: 400 naming it
    unknown = sorted(set(request.model_extra or {}) - set(UNSERVED))
    if unknown:
        log.info("ignoring unknown request fields: %s", unknown)
    service = registry.get(request.model)
    if getattr(service, "kind", ModelKind.ENCODER) != ModelKind.DECODER:
        routes = "/v1/rerank, /rerank and /v1/score" if service.kind == ModelKind.SCORER else "/v1/embeddings"
        raise BadRequest(f"`{service.model_id}` is an encoder engine: it serves {routes}, not generation",
                         param="model")
    return service


async def _answer(raw, service, jobs, request, chat: bool):
    from trtserve.server.completions import Deadline, SequenceStream, complete, stream

    state = serving(raw)
    deadline = Deadline(state.cfg.request_timeout)
    submission = service.submit(jobs)  # 429 / 503 here, as real statuses, before any byte is sent
    if request.stream:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        # Starlette cancels this generator when the client disconnects; the response closes the sequences
        return SequenceStream(stream(service, jobs, submission, chat, service.model_id, include_usage, deadline),
                              submission)
    try:
        return await unless_disconnected(raw, complete(service, jobs, submission, chat, service.model_id, deadline),
                                         state.metrics)
    finally:
        submission.close()
