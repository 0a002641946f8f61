"""Run an evaluation grid: one JSON line per configuration, appended and flushed as soon as it is
measured, so a rerun with --resume skips what is done and Ctrl-C loses nothing measured.

Per configuration: latency (warm-up, then runs until both min_runs and min_seconds are reached;
p50/p95/p99), throughput, peak RSS during the configuration, engine size, and fidelity of the
output against the torch fp32 baseline on the same batch (cosine, worst-token cosine, max abs
error, NaN/Inf count, top-1 for decoders)."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.eval.grid import INPUTS, Config, Grid
from trtserve.graph_files import graph_bytes
from trtserve.progress import say

if TYPE_CHECKING:
    from trtserve.engine_dir import EngineDir
    from trtserve.runtime.base import Backend

RESULTS = "results.jsonl"
ENGINES = "engines.json"  # each engine's build-time fidelity (its gate), written at the end of a run


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.time()

    def tick(self, label: str) -> None:
        self.done += 1
        rate = (time.time() - self.started) / self.done
        eta = rate * (self.total - self.done)
        width = 30
        filled = int(width * self.done / self.total)
        say(f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} ETA {eta:5.0f}s {label}")


def finished_keys(out: Path) -> set[str]:
    path = out / RESULTS
    if not path.is_file():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut by a crash: that configuration runs again
    return keys


def environment() -> dict:
    import onnxruntime
    import torch

    from trtserve import __version__
    from trtserve.runtime.base import available_cores

    return {"trtserve": __version__, "machine": platform.machine(), "processor": platform.processor(),
            "cores": available_cores(), "python": platform.python_version(), "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__}


def run_grid(grid: Grid, out: Path, resume: bool = False) -> Path:
    from trtserve.errors import TrtServeError

    out.mkdir(parents=True, exist_ok=True)
    done = finished_keys(out) if resume else set()
    if not resume and (out / RESULTS).exists():
        raise TrtServeError(f"{out / RESULTS} exists: pass --resume to continue it, or choose another --out")
    configs = [c for c in grid.configs() if c.key not in done]
    (out / "grid.json").write_text(json.dumps({"grid": grid.__dict__, "configurations": len(grid.configs()),
                                               "environment": environment()}, indent=1, default=list))
    say(f"eval {grid.name}: {len(grid.configs())} configurations, {len(done)} already measured, {len(configs)} to run")
    session = _Session(grid, out)
    progress = Progress(max(len(configs), 1))
    path = out / RESULTS
    if path.is_file() and path.stat().st_size and not path.read_bytes().endswith(b"\n"):
        with open(path, "a") as sink:  # a line cut by a crash stays on its own, ignored
            sink.write("\n")
    with open(path, "a") as sink:
        for config in configs:
            session.switch_to(config.model)
            row = session.measure(config)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            progress.tick(config.key)
    session.downstream()
    built = _earlier_engines(out) if resume else {}  # a resumed run opens only the engines its rows need
    built.update({f"{model}/{precision}": engine_fidelity(engine)
                  for (model, precision), engine in session.engines.items()})
    (out / ENGINES).write_text(json.dumps(built, indent=1))
    session.close()
    return out / RESULTS


def _earlier_engines(out: Path) -> dict:
    """The engines' gates recorded by the runs this one resumes (unreadable: none)."""
    try:
        earlier = json.loads((out / ENGINES).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return earlier if isinstance(earlier, dict) else {}


class _Session:
    """Engines, backends, inputs and baseline outputs, each made once and reused across configurations."""

    def __init__(self, grid: Grid, out: Path):
        self.grid, self.out = grid, out
        self.engines: dict[tuple, EngineDir] = {}
        self.backends: dict[tuple, Backend | None] = {}
        self.references: dict[tuple, np.ndarray] = {}
        self.why_not: dict[str, str] = {}
        self.unbuildable: dict[tuple, str] = {}  # (model, precision) -> why the build refused it
        self.loaded_bytes: dict[tuple, int | None] = {}  # RSS growth when a backend was loaded
        self.model: str | None = None  # the model whose sessions are loaded

    def close(self) -> None:
        for backend in self.backends.values():
            if backend is not None:
                backend.close()
        self.backends.clear()

    def switch_to(self, model: str) -> None:
        """Free the previous model's sessions (ONNX Runtime keeps each session's peak arena) and build
        all of this model's engines before any of its backends is loaded: together they do not fit."""
        if self.model == model:
            return
        import gc

        self.close()
        self.references.clear()
        gc.collect()
        self.model = model
        for precision in {"fp32"} | {c.precision for c in self.grid.configs() if c.model == model
                                      and c.backend in ("onnxruntime", "fp16-emulation")}:
            self._engine(model, precision)

    def measure(self, config: Config) -> dict:
        row = {"key": config.key, **config.__dict__, "seed": self.grid.seed, "time": time.time()}
        refused = self.unbuildable.get((config.model, config.precision))
        if refused is not None:  # never fp32, so never a torch row
            return {**row, "status": "skipped", "why": f"no {config.precision} engine of {config.model}: {refused}"}
        backend = self._backend(config)
        if backend is None:
            return {**row, "status": "skipped", "why": self.why_not[config.backend]}
        feeds = self._feeds(config, backend)
        _reset_peak_rss()
        before = _rss("VmRSS")
        try:
            samples, output = _timed(backend, feeds, self.grid.min_runs, self.grid.min_seconds)
        except Exception as exc:  # recorded, not fatal: the grid goes on
            return {**row, "status": "failed", "why": f"{type(exc).__name__}: {exc}"}
        engine = self.engines[(config.model, "fp32" if config.backend == "torch" else config.precision)]
        peak = _rss("VmHWM")
        working = None if peak is None or before is None else max(peak - before, 0)
        loaded = self.loaded_bytes.get((config.model, config.backend, config.precision))
        assert engine.manifest.onnx is not None
        row.update(status="ok", runs=len(samples), **_latency(samples, config), peak_rss_bytes=peak,
                   working_bytes=working, backend_load_bytes=loaded,
                   memory_bytes=None if working is None or loaded is None else working + loaded,
                   engine_bytes=graph_bytes(engine.path / "model.onnx"),  # its weights beside it included
                   engine_sha256=engine.manifest.onnx.sha256)
        if config.backend == "torch":  # kept for this shape's rows only: a decoder's logits are large
            self.references = {config.shape: output}
        reference = self._reference(config, feeds) if "torch" in self.grid.backends else None
        if reference is not None:
            row["fidelity"] = _fidelity(reference, output, engine.manifest.model.kind)
            row["fidelity_positions"] = "every"  # earlier runs judged at most 64 evenly spaced positions per row
            if config.backend != "torch":
                row["target_misses"] = _target_misses(row["fidelity"], config, engine.manifest)
        return row

    def _reference(self, config: Config, feeds: dict) -> np.ndarray:
        """The torch fp32 output of this shape (computed here when a resumed run lost it)."""
        if config.shape not in self.references:
            torch_config = Config(config.model, "torch", "fp32", config.batch, config.sequence, config.input)
            backend = self._backend(torch_config)
            self.references = {config.shape: backend.infer(feeds)[_output_name(backend)]}
        return self.references[config.shape]

    def downstream(self) -> None:
        """Sentiment accuracy on held-out real sentences under each backend and policy of the grid's encoders."""
        from trtserve.data.sentiment import downstream
        from trtserve.runtime.text import TextEngine

        done = set()
        for config in self.grid.configs():
            if config.backend != "torch" or config.input != "real" or config.model in done:
                continue
            done.add(config.model)
            if self._engine(config.model, "fp32").manifest.model.kind != ModelKind.ENCODER:
                continue
            self.switch_to(config.model)
            engines = {}
            for other in self.grid.configs():
                if (other.shape == config.shape and other.backend != "tensorrt"
                        and (other.model, other.precision) not in self.unbuildable):
                    engines[f"{other.backend}/{other.precision}"] = TextEngine(self._backend(other))
            say(f"eval: downstream sentiment accuracy of {config.model} under {len(engines)} backends/policies")
            result = downstream(engines, "torch/fp32", self.out)
            say("eval: held-out accuracy " + ", ".join(f"{k} {v:.3f}" for k, v in result["accuracy"].items()))

    def _engine(self, model: str, precision: str):
        from trtserve.engine_builder.build import BuildConfig, build_engine
        from trtserve.engine_dir import whole_engine_dir
        from trtserve.errors import TrtServeError
        from trtserve.fileio import build_code_digest, build_once, cache_root

        key = (model, precision)
        if key in self.unbuildable:
            return None
        if key not in self.engines:
            # at least 128 tokens: the downstream check embeds whole review sentences (up to about 70)
            max_seq, max_batch = max(max(self.grid.sequence), 128), max(self.grid.batch)
            # held to its target on every shape of this grid (the build's gate measures them with the ids the
            # rows feed: auto searches again, int8/int4 keep more weights safer, or the gate names the shape)
            shapes = self.grid.shapes(model)
            confirm = hashlib.sha256(json.dumps([shapes, self.grid.seed]).encode()).hexdigest()[:8]
            # keyed by the builder's code too: an engine an older trtserve built lacks what this one measures
            path = cache_root() / "eval" / (f"{model}-{precision}-b{max_batch}-s{max_seq}-g{confirm}-"
                                            f"{build_code_digest()[:12]}")

            def build():
                say(f"eval: building the {precision} engine of {model} (once, cached at {path})")
                return build_engine(BuildConfig(model=model, out=path, precision=precision, max_batch=max_batch,
                                                max_seq=max_seq, allow_low_fidelity=True,
                                                confirm_grid=self.grid.source or self.grid.name,
                                                confirm_shapes=shapes, confirm_seed=self.grid.seed))

            try:
                self.engines[key] = build_once(path, whole_engine_dir, build)
            except TrtServeError as exc:  # a policy this model cannot have (gguf of a non-GGUF checkpoint)
                if precision == "fp32":
                    raise
                say(f"eval: no {precision} engine of {model}: {exc}; its rows are recorded as skipped")
                self.unbuildable[key] = str(exc)
                return None
        return self.engines[key]

    def _backend(self, config: Config):
        key = (config.model, config.backend, config.precision)
        if key in self.backends:
            return self.backends[key]
        from trtserve.runtime import load_backend
        from trtserve.runtime.base import available_cores

        backend = None
        before = _rss("VmRSS")
        if config.backend == "tensorrt":
            from trtserve.runtime.devices import cuda_devices

            gpus, why = cuda_devices()
            self.why_not["tensorrt"] = ("TensorRT engines are not built by the evaluation yet" if gpus
                                        else f"needs a GPU and TensorRT: {why}")
        elif config.backend == "torch":
            backend = load_backend(self._engine(config.model, "fp32").path, "torch", threads=available_cores())
        elif config.backend == "onnxruntime":
            backend = load_backend(self._engine(config.model, config.precision).path)
        else:
            backend = self._emulation(config)
        after = _rss("VmRSS")
        self.loaded_bytes[key] = None if before is None or after is None else max(after - before, 0)
        self.backends[key] = backend
        return backend

    def _emulation(self, config: Config):
        """ONNX Runtime on the fp16 emulation graph: what an fp16 GPU would compute (fidelity only)."""
        from trtserve.fileio import cache_root
        from trtserve.graph_files import save_graph
        from trtserve.precision.run import emulation_of
        from trtserve.runtime.ort import OrtBackend

        engine = self._engine(config.model, config.precision)
        graph = cache_root() / "eval" / "emulation" / f"{engine.manifest.onnx.sha256[:16]}.onnx"
        if not graph.is_file():
            graph.parent.mkdir(parents=True, exist_ok=True)
            save_graph(emulation_of(engine), graph)
        return OrtBackend(engine, graph=graph)

    def _feeds(self, config: Config, backend) -> dict:
        from trtserve.precision.measure import grid_ids
        from trtserve.runtime.generate import logit_feed, start

        ids = grid_ids(backend.engine, config.input, config.batch, config.sequence, self.grid.seed)
        mask = np.ones_like(ids)
        names = {spec.name for spec in backend.inputs}
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        if "position_ids" in names:
            feeds["position_ids"] = np.tile(np.arange(config.sequence, dtype=np.int64), (config.batch, 1))
            feeds.update(logit_feed(backend, config.sequence, last_only=False))  # fidelity is on every position
            feeds.update(start(backend, config.batch).past)
        return feeds


def _output_name(backend) -> str:
    """The output fidelity is measured on: logits for decoders, hidden states for encoders."""
    return "logits" if "logits" in {s.name for s in backend.outputs} else "last_hidden_state"


def _timed(backend, feeds: dict, min_runs: int, min_seconds: float) -> tuple[list[float], np.ndarray]:
    output_name = _output_name(backend)
    backend.infer(feeds)  # warm-up
    samples: list[float]
    samples, started = [], time.perf_counter()
    while len(samples) < min_runs or (time.perf_counter() - started < min_seconds and len(samples) < 200):
        t0 = time.perf_counter()
        result = backend.infer(feeds)
        samples.append(time.perf_counter() - t0)
    return samples, result[output_name]


def _latency(samples: list[float], config: Config) -> dict:
    ms = np.array(samples) * 1000
    p50 = float(np.percentile(ms, 50))
    return {"latency_ms": {"p50": p50, "p95": float(np.percentile(ms, 95)), "p99": float(np.percentile(ms, 99)),
                           "mean": float(ms.mean())},
            "sequences_per_s": config.batch / (p50 / 1000),
            "tokens_per_s": config.batch * config.sequence / (p50 / 1000)}


def _fidelity(reference: np.ndarray, output: np.ndarray, kind: ModelKind) -> dict:
    from trtserve.precision.fidelity import compare, top1_agreement

    result = compare(reference, output)
    result["nonfinite_rate"] = result["nonfinite"] / max(output.size, 1)
    if kind == ModelKind.DECODER:
        result["top1"] = top1_agreement(reference, output)
    return result


def _target_misses(fidelity: dict, config: Config, manifest) -> list[str]:
    """How this row misses the fidelity target its engine was built to (`precision.measure.failures`; random
    ids judged by their own bounds, top-1 on real text only; every position of every row)."""
    from trtserve.precision.measure import Target, failures

    tensor = {k: fidelity[k] for k in ("cosine", "worst_row_cosine", "max_abs_error", "nonfinite")}
    case = {"input": config.input, "output": tensor}
    if "top1" in fidelity and config.input == "real":
        case["top1_agreement"] = fidelity["top1"]
    return failures({"cases": {config.key: case}}, Target(**manifest.fidelity.target))


def engine_fidelity(engine) -> dict:
    """What the engine's build measured (its gate): the worst of each metric per run, and the sentences."""
    from trtserve.precision.run import worst

    fidelity = engine.manifest.fidelity
    runs = {name: worst(run) for name, run in fidelity.runs().items()}
    sentences = {name: run["sentences"] for name, run in fidelity.runs().items() if run.get("sentences")}
    backend = engine.manifest.backend
    return {"passed": fidelity.passed, "failures": fidelity.failures, "lengths": fidelity.lengths,
            "target": fidelity.target, "runs": runs, "sentences": sentences,
            "resident_mb": backend and backend.resident_mb,  # a fresh process, loaded and run
            "grid_shapes": _grid_shapes(engine.manifest)}


def _grid_shapes(manifest) -> int:
    """How many of the gate's shapes came from `--confirm-grid` (the evaluation holds its engines to its grid)."""
    if manifest.confirm_grid is not None:
        name = manifest.confirm_grid.label
    else:  # built before the manifest recorded it
        parts = (manifest.build_command or "").split()
        if "--confirm-grid" not in parts:
            return 0
        name = Path(parts[parts.index("--confirm-grid") + 1]).stem
    grid_case = re.compile(rf"{re.escape(name)} ({'|'.join(INPUTS)}) b\d+ seq\d+")  # measure._label after the name
    return sum(bool(grid_case.fullmatch(label)) for label in manifest.fidelity.onnxruntime["cases"])


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux 4.0+)
    except OSError:
        pass


def _rss(field: str) -> int | None:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
