"""The Ray Serve replica: trtserve's ASGI app, built on the replica's node once its engine is there."""

from __future__ import annotations

from ray import serve

from trtserve.server.config import ServerConfig


@serve.deployment
@serve.ingress()
class TrtServeReplica:
    def __init__(self, models: list[str], repository: str | None, precision: str, backend: str, cfg: ServerConfig):
        from trtserve.deploy.engines import served_engines

        # On this replica's node: engines built for this GPU type and TensorRT version, or the CPU engines.
        self.engines = [(name, str(path)) for name, path in served_engines(models, repository, precision, backend)]
        self.cfg = cfg.model_copy(update={"engine_dir": self.engines[0][1]})
        self._trtserve_app = None

    def __serve_build_asgi_app__(self):
        from trtserve.server.app import build_app

        self._trtserve_app = build_app(self.cfg, self.engines)
        return self._trtserve_app

    async def check_health(self) -> None:
        """Ray restarts a replica whose check raises: here, when its backend stopped answering."""
        from trtserve.server.http import PROBE_EVERY

        app = self._trtserve_app
        registry = app.state.serving.registry if app is not None else None
        if registry is not None and not registry.healthy(3 * PROBE_EVERY):
            raise RuntimeError("the backend has not answered a probe recently")
