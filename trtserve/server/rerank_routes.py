"""Cross-encoder routes: /v1/rerank and /rerank (Cohere/Jina as vLLM serves them, or TEI's body), /v1/score."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request

from trtserve.engine_dir.kinds import ModelKind
from trtserve.server.errors import BadRequest
from trtserve.server.http import log, serving, unless_disconnected
from trtserve.server.protocol import RerankRequest, ScoreRequest

router = APIRouter()


def _scorer(raw: Request, name: str | None, extra):
    """The cross-encoder named (or the only engine, where the body names none, as TEI's does)."""
    if extra:
        log.info("ignoring unknown request fields: %s", sorted(extra))
    service = serving(raw).engines().get(name)
    if service.kind != ModelKind.SCORER:
        raise BadRequest(f"`{service.model_id}` is not a cross-encoder (a *ForSequenceClassification checkpoint): "
                         "it does not score pairs", param="model")
    return service


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: RerankRequest, raw: Request):
    service = _scorer(raw, request.model, request.model_extra)
    return await unless_disconnected(raw, service.rerank(request), serving(raw).metrics)


@router.post("/v1/score")
@router.post("/score")
async def score(request: ScoreRequest, raw: Request):
    service = _scorer(raw, request.model, request.model_extra)
    return await unless_disconnected(raw, service.score(request), serving(raw).metrics)
