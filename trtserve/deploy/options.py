"""`serve` options beyond the server's own (server/config.py): which engine to serve when given a
model rather than an engine directory, and the Ray Serve deployment. Defined once as settings
models (trtserve/settings.py): flags, TRTSERVE_* variables, help and checks come from here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trtserve.engine_builder import BACKENDS, PRECISIONS
from trtserve.settings import Settings


class ServeTarget(Settings):
    model: str | None = Field(None, description="engine directory, or a model (built once into the engine cache)")
    model_repository: str | None = Field(None, description="a folder whose subfolders are engine directories: "
                                         "each is served under its folder's name")
    # Literal of the names in the tuple: pydantic reads it so, mypy wants the values written out
    precision: Literal[PRECISIONS] = Field(  # type: ignore[valid-type]
        "fp32", description="when MODEL is a checkpoint: the precision policy of the engine built for it")
    backend: Literal[BACKENDS] = Field(  # type: ignore[valid-type]
        "auto", description="when MODEL is a checkpoint: the backend its engine is built for")


class RayOptions(Settings):
    ray: bool = Field(False, description="serve as a Ray Serve application, one replica per GPU (or per CPU "
                      "worker)")
    ray_address: str | None = Field(None, description="join this Ray cluster ('auto' or host:port; default: start "
                                    "a local one)")
    replicas: int | None = Field(None, ge=0, description="replicas (default: one per GPU of the cluster, else 1; "
                                 "0: autoscale)")
    max_replicas: int | None = Field(None, gt=0, description="with --replicas 0: the most replicas (default: as "
                                     "many as the cluster fits)")
    num_gpus_per_replica: float | None = Field(None, ge=0, description="GPUs per replica (default 1 where the "
                                               "cluster has GPUs, else 0)")
    num_cpus_per_replica: float = Field(1.0, gt=0, description="CPUs per replica, also its backend's threads")
