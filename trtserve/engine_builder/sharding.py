"""Parallel-track checkpoint -> engine dir with one ONNX engine per track per segment of D layers.

    embed.onnx              ids [B, T] -> hidden [B, T, d]                 (replicated on every worker)
    track{i}.seg{j}.onnx    hidden, past k/v of the segment's D layers -> update [B, T, d], presents
    head.onnx               hidden of the last position [B, d] -> logits [B, V]   (replicated)
    vocab.json              the model's compact vocabulary as tokenizer ids (-1: the unknown id)

Each graph carries the precision policy (the same passes as every other engine), then is
optimized by ONNX Runtime; the manifest records tracks, segments and the sync schedule: after
segment j every worker all-reduces (sums) its tracks' updates and adds them to the hidden state.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from trtserve import engine_dir
from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import TrtServeError
from trtserve.fileio import atomic_dir, check_writable_target
from trtserve.models.parallel_track import TOKENIZER_FILES
from trtserve.progress import say

OPSET = 20
EXPORT_FORMAT = 2  # bump when what _export_all writes changes (2: projections as MatMuls on 2-D weights)


def segment_file(track: int, segment: int, optimized: bool = True) -> str:
    return f"track{track}.seg{segment}{'.ort' if optimized else ''}.onnx"


def _modules(model, track: int, segment: int):
    import torch

    from trtserve.models.pt_model import block

    cfg = model.cfg
    layers = list(range(segment * cfg.block_depth, (segment + 1) * cfg.block_depth))
    heads, kv = cfg.num_heads // cfg.n_tracks, cfg.num_kv_heads // cfg.n_tracks

    class Segment(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for layer in layers:
                for name, p in model.layers[layer].params(slice(track, track + 1)).items():
                    # projections as plain matrices: MatMuls on 2-D constants, which int8/int4 quantize
                    self.register_buffer(f"l{layer}_{name}", (p[0] if p.ndim == 3 else p).detach().clone())

        def forward(self, hidden, *past):
            x, presents = hidden[None], []
            for j, layer in enumerate(layers):
                p = {name: getattr(self, f"l{layer}_{name}") for name in model.layers[layer].params()}
                x, (k, v) = block(p, x, cfg, heads, kv, past=(past[2 * j], past[2 * j + 1]))
                presents += [k, v]
            return (x[0] - hidden, *presents)

    return Segment().eval(), layers


def _export(module, args, names, outputs, shapes, out: Path) -> None:
    import torch

    with torch.no_grad():
        torch.onnx.export(module, args, str(out), dynamo=True, opset_version=OPSET, input_names=names,
                          output_names=outputs, dynamic_shapes=shapes, external_data=True, verbose=False)


def _export_all(model, tmp: Path) -> dict:
    """Write every fp32 graph into tmp; return {file: (input names, output names)}."""
    import torch
    from torch.export import Dim

    cfg = model.cfg
    batch, seq, past = 2, 3, 4  # traced with a non-empty cache, so nothing specialises on it
    kv = cfg.num_kv_heads // cfg.n_tracks
    graphs = {}

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = model.embed.weight.detach().clone()

        def forward(self, ids):
            return torch.nn.functional.embedding(ids, self.weight)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.weight = model.norm.weight.detach().clone(), model.embed.weight.detach().clone()

        def forward(self, hidden):
            from trtserve.models.pt_model import _rms

            return torch.matmul(_rms(hidden, self.norm, cfg.rms_norm_eps), self.weight.t())  # a MatMul, not a Gemm

    _export(Embed().eval(), (torch.randint(0, cfg.vocab_size, (batch, seq)),), ["input_ids"], ["hidden"],
            ({0: Dim.AUTO, 1: Dim.AUTO},), tmp / "embed.onnx")
    graphs["embed.onnx"] = (["input_ids"], ["hidden"])
    _export(Head().eval(), (torch.randn(batch, cfg.hidden_size),), ["hidden"], ["logits"],
            ({0: Dim.AUTO},), tmp / "head.onnx")
    graphs["head.onnx"] = (["hidden"], ["logits"])
    for track in range(cfg.n_tracks):
        for segment in range(cfg.segments):
            module, layers = _modules(model, track, segment)
            names = ["hidden"] + [f"past_{kind}.{layer}" for layer in layers for kind in ("key", "value")]
            outputs = ["update"] + [f"present_{kind}.{layer}" for layer in layers for kind in ("key", "value")]
            args = [torch.randn(batch, seq, cfg.hidden_size)]
            args += [torch.randn(batch, kv, past, cfg.head_dim) for _ in range(2 * len(layers))]
            shapes = ({0: Dim.AUTO, 1: Dim.AUTO}, tuple({0: Dim.AUTO, 2: Dim.AUTO} for _ in range(2 * len(layers))))
            say(f"export: track {track}, segment {segment} (layers {layers[0]}..{layers[-1]})")
            _export(module, tuple(args), names, outputs, shapes, tmp / segment_file(track, segment, False))
            graphs[segment_file(track, segment, False)] = (names, outputs)
    return graphs


def _build_command(checkpoint, out, precision: str, target, allow_low_fidelity: bool) -> str:
    parts = ["trtserve", "build-engine", str(checkpoint), "--out", str(out), "--precision", precision]
    if target is not None:
        parts += ["--fidelity-target", target.text()]
    if allow_low_fidelity:
        parts.append("--allow-low-fidelity")
    return " ".join(parts)


def build_track_engines(checkpoint: Path, out: Path, precision: str = "fp32", target=None,
                        allow_low_fidelity: bool = False) -> engine_dir.EngineDir:
    """Export, apply the precision policy to, and optimize every graph of a PT checkpoint.

    int8/int4 (precision.track_quant): each track's projections in the format the sensitivity choice gives
    them, then the first int8-activation plan whose engines meet `target` (the policy's default if None) on
    held-out text; none meeting it is an error unless `allow_low_fidelity`."""
    from trtserve.models.pt_model import load_checkpoint
    from trtserve.precision.write import check_precision, rewrite_float, track_choice, write_track_precision
    from trtserve.runtime.track_engines import TrackEngines

    check_precision(precision, tracks=True)
    check_writable_target(Path(out))
    model = load_checkpoint(checkpoint)
    cfg = model.cfg
    started = time.time()
    chosen = track_choice(precision, model, target)  # int8/int4: each weight's format; before the long export
    exports, graphs = _exports_cached(Path(checkpoint), model)
    with atomic_dir(Path(out)) as tmp:
        (tmp / "vocab.json").write_text(json.dumps(model.vocab.tolist()))  # compact id -> tokenizer id (-1: unknown)
        for name in (*TOKENIZER_FILES, "config.json"):
            if (Path(checkpoint) / name).is_file():
                (tmp / name).write_bytes((Path(checkpoint) / name).read_bytes())
        files = {name: {"graph": name.replace(".onnx", ".ort.onnx"), "inputs": inputs, "outputs": outputs}
                 for name, (inputs, outputs) in graphs.items()}
        manifest = {
            "model": {"id": Path(checkpoint).name, "kind": ModelKind.PARALLEL_TRACK, "source": str(checkpoint),
                      "architecture": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "num_layers",
                                                                    "num_heads", "num_kv_heads", "head_dim",
                                                                    "intermediate_size", "max_positions")}},
            "precision": {"policy": precision},
            "parallel_tracks": {
                "tracks": cfg.n_tracks, "block_depth": cfg.block_depth, "segments": cfg.segments,
                "layers_per_segment": [list(range(j * cfg.block_depth, (j + 1) * cfg.block_depth))
                                       for j in range(cfg.segments)],
                "kv_heads_per_track": cfg.num_kv_heads // cfg.n_tracks,
                "sync": {"op": "all_reduce_sum", "of": "each track's update to the hidden state",
                         "after_segments": list(range(cfg.segments)), "per_forward": cfg.segments},
                "graphs": files, "embed": "embed.onnx", "head": "head.onnx",
                "segment_graphs": [[segment_file(i, j, False) for j in range(cfg.segments)]
                                   for i in range(cfg.n_tracks)],
            },
            "build_command": _build_command(checkpoint, out, precision, target, allow_low_fidelity),
        }
        if chosen is None:
            _write_graphs(exports, tmp, graphs, lambda graph, _: rewrite_float(graph, precision))
        else:
            def engines():
                return TrackEngines(tmp, manifest, tracks=range(cfg.n_tracks), threads=None)

            entries = write_track_precision(precision, model, chosen, lambda rewrite, int8: _write_graphs(
                exports, tmp, graphs, rewrite, int8), engines)
            report = entries.pop("fidelity")
            manifest.update(precision={"policy": precision, **entries}, fidelity=report)
            if not report["passed"] and not allow_low_fidelity:
                raise TrtServeError(
                    f"the {precision} track engines miss the fidelity target ({len(report['failures'])} failures, "
                    f"e.g. {'; '.join(report['failures'][:3])}); nothing was written. Use --precision fp32 or "
                    "hybrid, relax --fidelity-target, or pass --allow-low-fidelity to keep them anyway")
        manifest.update(parity=_parity(model, tmp, manifest), build_seconds=round(time.time() - started, 1))
        engine_dir.seal(tmp, manifest)
    say(f"track engines: {cfg.n_tracks} tracks x {cfg.segments} segments -> {out}")
    return engine_dir.open_engine_dir(out, verify=False)


def _exports_cached(checkpoint: Path, model) -> tuple[Path, dict]:
    """The fp32 graphs (and {file: (input names, output names)}): exports are most of a build's time, so one
    is kept keyed by the checkpoint's files and the toolchain, and every precision starts from it."""
    import hashlib

    import torch

    from trtserve.fileio import build_once, cache_root, sha256_file
    from trtserve.models.parallel_track import WEIGHTS

    digest = hashlib.sha256("".join(sha256_file(checkpoint / f) for f in ("config.json", WEIGHTS)).encode())
    cached = cache_root() / "onnx" / f"pt-{digest.hexdigest()[:16]}-f{EXPORT_FORMAT}-torch{torch.__version__}"

    def reuse(path: Path) -> Path | None:
        if (path / "graphs.json").is_file():
            say(f"export: reusing cached fp32 graphs {path}")
            return path
        return None

    def export() -> Path:
        with atomic_dir(cached) as tmp:
            (tmp / "graphs.json").write_text(json.dumps(_export_all(model, tmp)))
        return cached

    build_once(cached, reuse, export)
    return cached, {name: tuple(io) for name, io in json.loads((cached / "graphs.json").read_text()).items()}


def _write_graphs(exports: Path, tmp: Path, graphs: dict, rewrite, int8_activations: frozenset | None = None) -> None:
    """Each fp32 export rewritten to tmp/NAME and optimized by ONNX Runtime to tmp/NAME.ort.onnx."""
    from trtserve.engine_builder.onnxruntime import OPTIMIZED, build_ort
    from trtserve.graph_files import load_graph, move_graph, save_graph

    for name in graphs:
        save_graph(rewrite(load_graph(exports / name), name), tmp / name)
        build_ort(tmp / name, tmp, int8_activations)
        move_graph(tmp / OPTIMIZED, tmp / name.replace(".onnx", ".ort.onnx"))


def _parity(model, directory: Path, manifest: dict) -> dict:
    """The engines chained in one process against the torch reference: a prompt, then 8 decode steps."""
    import torch

    from trtserve.runtime.track_engines import TrackEngines

    engines = TrackEngines(directory, manifest, tracks=range(model.cfg.n_tracks), threads=None)
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 16))
    worst = 0.0
    with torch.no_grad():
        logits, past = model(torch.as_tensor(ids))
        got = engines.forward(ids, reduce=lambda x: x)
        worst = max(worst, float(np.abs(got - logits[:, -1].numpy()).max()))
        for _ in range(8):
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits, past = model(token, past)
            got = engines.forward(token.numpy(), reduce=lambda x: x, new=False)
            worst = max(worst, float(np.abs(got - logits[:, -1].numpy()).max()))
    return {"max_abs_error": worst, "steps": 9, "against": "torch fp32 reference, all tracks in one process"}
