"""The service skeleton every engine kind shares (no FastAPI here): the engine directory, its
tokenizer and special tokens, the model name clients use, /v1/models and the model check, and the
lifecycle the app drives (start, stop, probe, healthy, worker status). The specialisations are
EmbeddingService (server/embeddings.py), ScoreService (server/scoring.py) and GenerationService
(server/generation.py)."""

from __future__ import annotations

import functools
import logging
import time
from typing import ClassVar

from trtserve.engine_dir.kinds import ModelKind
from trtserve.server.config import ServerConfig, placement
from trtserve.server.errors import ModelNotFound
from trtserve.server.protocol import ModelCard, ModelList

log = logging.getLogger("trtserve.server")


class Service:
    kind: ClassVar[ModelKind]  # the routes the app serves for it: each specialisation sets it

    def __init__(self, cfg: ServerConfig, metrics=None, verify: bool = False):
        """`verify`: check the engine's files here (services whose worker processes do not)."""
        from trtserve.engine_dir import open_engine_dir
        from trtserve.runtime.text import SpecialTokens, load_tokenizer

        self.cfg, self.metrics = cfg, metrics
        self.engine = open_engine_dir(cfg.engine_dir, verify=verify)
        self.manifest = self.engine.manifest
        self.tokenizer = load_tokenizer(self.engine.path)
        self.special = SpecialTokens.of(self.engine.path, self.tokenizer)
        self.model_id = cfg.served_model_name or self.manifest.model.id
        self.created = int(time.time())

    @functools.cached_property
    def served_by(self) -> tuple[str, str]:
        """(backend, why) that its workers load (runtime.runtime_for)."""
        from trtserve.runtime import runtime_for

        return runtime_for(self.engine)

    def worker_pool(self, generation: dict | None = None, ranks: dict | None = None):
        """Worker processes (or the in-process worker) for this engine, placed on this machine; `ranks`: a
        track-sharded engine's rank options, served by one worker."""
        from trtserve.server.workers import WorkerPool

        count, devices, threads, why = placement(self.cfg.workers, self.cfg.threads)
        if ranks is not None:
            count = min(count, 1)
        log.info("workers: %s; backend: %s (%s)", why, *self.served_by)
        return WorkerPool(str(self.engine.path), count, devices, threads, self.metrics, generation=generation,
                          deadline=self.cfg.worker_timeout, heartbeat=self.cfg.heartbeat_timeout, ranks=ranks)

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_id, created=self.created)])

    def check_model(self, name: str | None) -> None:
        """`name` is this engine's (None: left out of the request, which then means this one)."""
        if name is not None and name != self.model_id:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves `{self.model_id}`",
                                param="model", code="model_not_found")

    # -- lifecycle: each specialisation runs its own workers --------------------------------------
    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def probe(self) -> None:
        """Real work on every worker; a success refreshes what `healthy` reads."""
        raise NotImplementedError

    def healthy(self, within: float) -> bool:
        raise NotImplementedError

    def workers(self) -> list[dict]:
        """What /health shows of each worker."""
        raise NotImplementedError
