"""torch fp32 reference backend: the same graph module that was exported, run eagerly.

It takes the same feeds as every other backend, so it is the baseline for speed and fidelity.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trtserve.engine_dir import EngineDir
from trtserve.runtime.base import Abilities, available_cores, check_feeds, io_specs


class TorchBackend:
    name = "torch"
    abilities = Abilities()

    def __init__(self, engine: EngineDir, threads: int | None = None):
        import torch

        from trtserve.models.loading import load_torch_model
        from trtserve.models.sources import resolve
        from trtserve.models.wrappers import graph_for

        torch.set_num_threads(threads or available_cores())
        self.engine = engine
        self.inputs, self.outputs = io_specs(engine.manifest)
        self.ranges = engine.manifest.shapes
        source = resolve(engine.manifest.model.source)
        model = load_torch_model(source)
        self.module = graph_for(model, source)
        self._torch = torch

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feeds(feeds, self.inputs, self.ranges)
        args = [self._torch.from_numpy(np.ascontiguousarray(feeds[spec.name])) for spec in self.inputs]
        names = [spec.name for spec in self.inputs]
        if "position_ids" in names and "logit_positions" not in names:  # an engine from before that input
            args.insert(3, self._torch.arange(feeds["input_ids"].shape[1]))
        with self._torch.inference_mode():
            values = self.module(*args)
        values = (values,) if isinstance(values, self._torch.Tensor) else values  # one output: a scorer's logits
        return {spec.name: value.numpy() for spec, value in zip(self.outputs, values)}

    def close(self) -> None:
        self.module = None
