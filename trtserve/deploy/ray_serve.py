"""`trtserve serve --ray`: the same ASGI application as a Ray Serve deployment, one replica per GPU or CPU worker.

Each replica resolves its engines on its own node (built once per GPU type, see deploy/engines.py),
runs their backends in its own process, and serves trtserve's routes; with several engines (or a
model repository) every replica holds all of them, as one `trtserve serve` process does, so one
deployment serves every model and Ray's replicas scale them together; Ray's proxy spreads requests
over the replicas, restarts replicas that die or fail `check_health`, and scales them when asked.
Our queue limits become Ray's: `--max-queue` bounds both the requests in flight at a replica
(`max_ongoing_requests`) and those waiting at the proxy (`max_queued_requests`, then 429).
"""

from __future__ import annotations

import sys

from trtserve.deploy.options import RayOptions
from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import TrtServeError
from trtserve.server.config import ServerConfig

APP_NAME = "trtserve"


def model_kind(model: str) -> ModelKind:
    """The model's kind (an engine's or a checkpoint's), read without building anything."""
    from pathlib import Path

    from trtserve.engine_dir import MANIFEST, open_engine_dir
    from trtserve.models.family import detect, read_config
    from trtserve.models.sources import resolve

    path = Path(model)
    if (path / MANIFEST).is_file():
        return open_engine_dir(path, verify=False).manifest.model.kind
    if (path / "config.json").is_file():
        return detect(read_config(path)).kind
    return resolve(model).info.kind


def deployment_options(cfg: ServerConfig, kind: ModelKind, opts: RayOptions, gpus: float, cpus: float) -> dict:
    """Ray Serve deployment options from our limits and the cluster's resources."""
    per_gpu = opts.num_gpus_per_replica if opts.num_gpus_per_replica is not None else (1.0 if gpus else 0.0)
    if per_gpu > 0 and gpus < per_gpu:
        raise TrtServeError(f"--num-gpus-per-replica {per_gpu} but the Ray cluster has {gpus:g} GPU(s): "
                            "lower it, or add GPU nodes to the cluster")
    if opts.num_cpus_per_replica > cpus:
        raise TrtServeError(f"--num-cpus-per-replica {opts.num_cpus_per_replica:g} but the Ray cluster has "
                            f"{cpus:g} CPU(s)")
    fit = int(gpus // per_gpu) if per_gpu else max(1, int(cpus // max(opts.num_cpus_per_replica, 1e-9)))
    options = {
        "name": "TrtServeReplica",
        "ray_actor_options": {"num_cpus": opts.num_cpus_per_replica, "num_gpus": per_gpu},
        "max_ongoing_requests": cfg.max_queue,
        "max_queued_requests": cfg.max_queue,
        "backpressure_config": {"status_code": 429, "retry_after_s": 1},
        "health_check_period_s": 5.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": max(cfg.drain_timeout, 1.0),
    }
    if opts.replicas == 0:
        busy = cfg.max_num_seqs if kind == ModelKind.DECODER else cfg.max_batch  # one full batch per replica
        options["autoscaling_config"] = {"min_replicas": 1, "max_replicas": opts.max_replicas or fit,
                                         "target_ongoing_requests": busy}
    else:
        options["num_replicas"] = opts.replicas if opts.replicas is not None else (fit if per_gpu else 1)
    return options


def replica_config(cfg: ServerConfig, cpus_per_replica: float) -> ServerConfig:
    """A replica is one worker: the backend runs in the replica's process with its share of the cores."""
    return cfg.model_copy(update={"workers": 0, "threads": max(1, int(cpus_per_replica))})


def build_application(models: list[str], repository: str | None, precision: str, backend: str, cfg: ServerConfig,
                      options: dict):
    from trtserve.deploy.ray_replica import TrtServeReplica

    cpus = options["ray_actor_options"]["num_cpus"]
    # the ignore: ray's serve.ingress types the class it decorates as the class, not the Deployment it is
    return TrtServeReplica.options(**options).bind(  # type: ignore[attr-defined]
        models, repository, precision, backend, replica_config(cfg, cpus))


def run(models: list[str], precision: str, backend: str, cfg: ServerConfig, opts: RayOptions, blocking: bool = True,
        repository: str | None = None):
    """Start (or join) a Ray cluster, deploy, and serve on cfg.host:cfg.port until interrupted. MODELS as
    `trtserve serve` takes them ([NAME=]MODEL); every replica holds all of them."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise TrtServeError("--ray needs Ray Serve: pip install 'trtserve[ray]'") from None
    from pathlib import Path

    from trtserve.deploy.engines import repository_folders, split_name
    from trtserve.engine_dir import MANIFEST

    named = [split_name(m) for m in models] + [(p.name, str(p)) for p in repository_folders(repository)]
    paths = [path for _, path in named]
    if all((Path(p) / MANIFEST).is_file() for p in paths):  # names clash here, not in crash-looping replicas
        from trtserve.server.registry import plan

        plan(cfg, named)
    kinds = [model_kind(p) for p in paths]
    kind = ModelKind.DECODER if ModelKind.DECODER in kinds else kinds[0]  # a replica is busy when its decoder is
    ray.init(address=opts.ray_address, include_dashboard=False, ignore_reinit_error=True, log_to_driver=False)
    resources = ray.cluster_resources()
    options = deployment_options(cfg, kind, opts, resources.get("GPU", 0.0), resources.get("CPU", 0.0))
    try:
        serve.start(http_options={"host": cfg.host, "port": cfg.port})
    except ray.exceptions.RayError as exc:
        raise TrtServeError(_ray_failure("could not start its HTTP proxy", exc)) from None
    print(f"ray serve: {', '.join(f'{p} ({k})' for p, k in zip(paths, kinds))} on http://{cfg.host}:{cfg.port}, "
          f"{options.get('num_replicas', 'autoscaled')} replica(s), "
          f"{options['ray_actor_options']['num_gpus']:g} GPU and {options['ray_actor_options']['num_cpus']:g} CPU "
          "each", file=sys.stderr)
    app = build_application(models, repository, precision, backend, cfg, options)
    try:
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
    except (ray.exceptions.RayError, RuntimeError) as exc:
        raise TrtServeError(_ray_failure("could not deploy the replicas", exc)) from None
    if not blocking:
        return
    try:
        import time

        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("ray serve: shutting down", file=sys.stderr)
    finally:
        serve.shutdown()


def _ray_failure(what: str, exc: Exception) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (f"Ray Serve {what}: {first}. The replica and proxy logs are under /tmp/ray/session_latest/logs/serve/ "
            "on each node; on a heavily loaded machine start the cluster with "
            "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=30 in its environment")
