"""The engines one server holds, by the model name clients use: each has its own service (workers,
queue, batcher, limits); requests are routed by their `model`. No FastAPI here."""

from __future__ import annotations

import asyncio
import logging

from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import TrtServeError
from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, ModelNotFound
from trtserve.server.protocol import ModelList

log = logging.getLogger("trtserve.server")


def plan(cfg: ServerConfig, engines: list[tuple[str | None, str]] | None = None) -> dict[str, ServerConfig]:
    """Model name -> the config of its service, for `engines` as (name or None, engine dir); without
    them, cfg.engine_dir alone. A name is the one given, else --served-model-name (one engine only),
    else the manifest's model id. Two engines under one name are refused here, before anything starts."""
    from trtserve.engine_dir import open_engine_dir

    engines = engines or [(cfg.served_model_name, cfg.engine_dir)]
    if cfg.served_model_name and len(engines) > 1:
        raise TrtServeError("--served-model-name names one engine; with several, name each as NAME=DIR")
    named: dict[str, ServerConfig] = {}
    for name, path in engines:
        name = name or cfg.served_model_name or open_engine_dir(path, verify=False).manifest.model.id
        if name in named:
            raise TrtServeError(f"two engines would be served as `{name}` ({named[name].engine_dir} and {path}): "
                                "give each its own name as NAME=DIR")
        named[name] = cfg.model_copy(update={"engine_dir": str(path), "served_model_name": name})
    return named


class Registry:
    def __init__(self, configs: dict[str, ServerConfig], metrics):
        self.services = {name: make_service(c, metrics.of(name)) for name, c in configs.items()}

    def __len__(self) -> int:
        return len(self.services)

    def names(self) -> str:
        return ", ".join(f"`{name}`" for name in self.services)

    def get(self, name: str | None):
        """The service serving `name`; 404 naming the ones this server has. Without a name (`model` left out of
        a request, as vLLM and llama-server allow), the only engine; 400 listing them when there are several."""
        if name is None:
            if len(self.services) == 1:
                return next(iter(self.services.values()))
            raise BadRequest(f"give `model`: this server serves {len(self.services)} models ({self.names()})",
                             param="model")
        service = self.services.get(name)
        if service is None:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves {self.names()}",
                                param="model", code="model_not_found")
        return service

    def models(self) -> ModelList:
        return ModelList(data=[card for s in self.services.values() for card in s.models().data])

    async def start(self) -> None:
        """One engine after the other (their loads would compete for the same cores); if one fails,
        those started are stopped and the error is the server's."""
        started = []
        try:
            for name, service in self.services.items():
                await service.start()
                started.append(service)
                log.info("serving %s (%s) from %s", name, service.kind, service.cfg.engine_dir)
        except BaseException:
            await asyncio.gather(*(s.stop() for s in started), return_exceptions=True)
            raise

    async def stop(self) -> None:
        await asyncio.gather(*(s.stop() for s in self.services.values()), return_exceptions=True)

    async def probe(self) -> None:
        results = await asyncio.gather(*(s.probe() for s in self.services.values()), return_exceptions=True)
        for name, result in zip(self.services, results):
            if isinstance(result, Exception):  # its probe time goes stale: /health turns 503 for it
                log.error("health probe of %s failed: %s", name, result)

    def healthy(self, within: float) -> bool:
        return all(s.healthy(within) for s in self.services.values())

    def unhealthy(self, within: float) -> dict[str, str]:
        """Model name -> why it is not ready, for each engine that is not."""
        why = {}
        for name, service in self.services.items():
            if not service.healthy(within):
                down = [w["index"] for w in service.workers() if not w["ready"]]
                why[name] = f"worker(s) {down} are restarting" if down else "a worker has not answered a probe recently"
        return why


def make_service(cfg: ServerConfig, metrics):
    """The embeddings service for an encoder engine, the scoring service for a cross-encoder, the generation
    service for a decoder."""
    from trtserve.engine_dir import open_engine_dir
    from trtserve.server.generation import check_tracks_option

    manifest = open_engine_dir(cfg.engine_dir, verify=False).manifest
    check_tracks_option(cfg.engine_dir, manifest, cfg.tracks, cfg.workers)
    kind = manifest.model.kind
    if kind in (ModelKind.DECODER, ModelKind.PARALLEL_TRACK):
        from trtserve.server.generation import GenerationService

        return GenerationService(cfg, metrics)
    if kind == ModelKind.SCORER:
        from trtserve.server.scoring import ScoreService

        return ScoreService(cfg, metrics)
    from trtserve.server.embeddings import EmbeddingService

    return EmbeddingService(cfg, metrics)
