"""TensorRT runtime backend (GPU): the same Backend protocol as ONNX Runtime.

Written against the TensorRT 11 API: deserialize the plan, one execution context per optimization
profile, device buffers (torch CUDA tensors) sized from the profile maxima and shared by the
contexts, pinned host staging, `execute_async_v3` on one stream, and optional CUDA-graph capture
for repeated fixed shapes (decode steps). Whether a plan may load here is decided before TensorRT
sees it (trt_plan.check_loadable)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from trtserve.engine_dir import EngineDir
from trtserve.errors import EngineDirError
from trtserve.runtime.base import Abilities, check_feeds, io_specs
from trtserve.runtime.trt_plan import buffer_plan, check_loadable, select_profile

if TYPE_CHECKING:
    import torch

TORCH_DTYPE = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int64": "int64",
               "int32": "int32", "bool": "bool"}


class TrtBackend:
    name = "tensorrt"
    abilities = Abilities()  # decoding copies the cache: no in-place decode graph on TensorRT yet

    def __init__(self, engine: EngineDir, device: int = 0, cuda_graphs: bool = False):
        import torch

        from trtserve.runtime.devices import cuda_device_info
        from trtserve.runtime.trt_lib import load_tensorrt, logger

        entry = engine.manifest.tensorrt
        if not entry:
            raise EngineDirError(f"{engine.path} has no TensorRT plan: rebuild it with `{engine.rebuild} "
                                 "--backend tensorrt`, or serve it with ONNX Runtime")
        trt, flavour = load_tensorrt()
        check_loadable(entry, flavour, trt.__version__, cuda_device_info(), engine.rebuild)
        self.engine, self.entry, self.torch = engine, entry, torch
        self.inputs, self.outputs = io_specs(engine.manifest)
        self.ranges = engine.manifest.shapes
        self.profiles = entry.profiles
        self.device = torch.device("cuda", device)
        self._log = logger(trt)
        self.runtime = trt.Runtime(self._log)
        self.plan = self.runtime.deserialize_cuda_engine(engine.file(entry.plan).read_bytes())
        if self.plan is None:
            raise EngineDirError(f"TensorRT refused the plan in {engine.path}: "
                                 + ("; ".join(self._log.errors()[:3]) or "no error was logged"))
        self.stream = torch.cuda.Stream(self.device)
        self.contexts = []
        for index in range(len(self.profiles)):
            context = self.plan.create_execution_context()
            context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(context)
        sizes = buffer_plan(engine.manifest.io, self.profiles)
        self.device_buffers = {name: torch.empty(max(n, 1), dtype=getattr(torch, TORCH_DTYPE[dtype]),
                                                 device=self.device)
                               for name, (dtype, n) in sizes.items()}
        self.host_buffers = {name: torch.empty(max(n, 1), dtype=getattr(torch, TORCH_DTYPE[dtype]), pin_memory=True)
                             for name, (dtype, n) in sizes.items()}
        self.cuda_graphs = cuda_graphs
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.stream.synchronize()

    def infer(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        torch = self.torch
        bound = check_feeds(feeds, self.inputs, self.ranges)
        profile = select_profile(self.profiles, bound)
        context = self.contexts[profile]
        with torch.cuda.stream(self.stream):
            for spec in self.inputs:
                array = np.ascontiguousarray(feeds[spec.name])
                host = self.host_buffers[spec.name][: array.size]
                host.copy_(torch.from_numpy(array).reshape(-1))
                self.device_buffers[spec.name][: array.size].copy_(host, non_blocking=True)
                context.set_input_shape(spec.name, array.shape)
                context.set_tensor_address(spec.name, self.device_buffers[spec.name].data_ptr())
            shapes = {}
            for spec in self.outputs:
                shapes[spec.name] = tuple(context.get_tensor_shape(spec.name))
                context.set_tensor_address(spec.name, self.device_buffers[spec.name].data_ptr())
            self._execute(context, profile, tuple(feeds[s.name].shape for s in self.inputs))
            results = {}
            for spec in self.outputs:
                n = int(np.prod(shapes[spec.name]))
                self.host_buffers[spec.name][:n].copy_(self.device_buffers[spec.name][:n], non_blocking=True)
            self.stream.synchronize()
            for spec in self.outputs:
                n = int(np.prod(shapes[spec.name]))
                results[spec.name] = self.host_buffers[spec.name][:n].numpy().reshape(shapes[spec.name]).copy()
        return results

    def _execute(self, context, profile: int, key_shapes: tuple) -> None:
        """Run the context; with cuda_graphs, replay a captured graph for shapes seen before. Buffer
        addresses never change, so a graph captured once stays valid for its shapes."""
        torch = self.torch
        key = (profile, key_shapes)
        graph = self._graphs.get(key) if self.cuda_graphs else None
        if graph is not None:
            graph.replay()
            return
        if not context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed: " + "; ".join(self._log.errors()[-3:]))
        if self.cuda_graphs and len(self._graphs) < 64:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                context.execute_async_v3(self.stream.cuda_stream)
            self._graphs[key] = graph

    def close(self) -> None:
        self._graphs.clear()
        self.contexts = []
        self.plan = None
