"""TensorRT plan builder (TensorRT 11 / TensorRT-RTX: strongly typed, precision from the graph's casts).

Parses the mixed-precision ONNX, checks that every layer the graph keeps fp32 is fp32 in the
network, adds optimization profiles from the manifest's shape ranges, and serializes the plan.
Nothing here needs a GPU: TensorRT-RTX builds portable plans on a CPU-only machine."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from trtserve.engine_dir.kinds import ModelKind
from trtserve.engine_dir.manifest import IO, Profile, Range, Shapes
from trtserve.errors import TrtServeError
from trtserve.fileio import sha256_file
from trtserve.progress import say

PLAN = "model.plan"
FLOAT_TYPES = {1: "FLOAT", 10: "HALF", 16: "BF16"}  # ONNX TensorProto elem types -> TensorRT DataType names


@dataclass(frozen=True)
class TrtOptions:
    workspace_mib: int | None = None  # memory-pool limit for tactics; None: TensorRT's default (device memory)
    timing_cache: Path | None = None  # full TensorRT only; None: one per TensorRT version under the cache dir
    version_compatible: bool = False  # plan runs on later TensorRT versions (lean runtime)
    hardware_compatibility: str = "none"  # none | ampere_plus | same_compute_capability (full TensorRT)
    compute_capabilities: tuple[str, ...] = field(default=())  # TensorRT-RTX targets, e.g. ("8.6",); () = portable


PROMPT_LOGPROBS_BATCH = 4  # rows of the profile that returns every position's logits


def profiles_for(kind: ModelKind, shapes: Shapes, io: IO) -> list[Profile]:
    """Optimization profiles from the manifest's shape ranges: one for encoders; for decoders one
    for prefill (past 0 at opt) and one for single-token decode over a growing past, both with the
    logits of one position per row; and, for the prompt's logprobs, one whose rows (at most
    PROMPT_LOGPROBS_BATCH) return every position, so that the logits buffer is sized for that
    batch, not for the largest batch times the longest prompt."""
    if kind in (ModelKind.ENCODER, ModelKind.SCORER):
        plans = [("all", {"batch": shapes.batch, "sequence": shapes.sequence})]
    else:
        seq, past, total = shapes.sequence, shapes.past_sequence, shapes.total_sequence
        assert past is not None and total is not None  # a decoder's
        one = {"logit_positions": Range(min=1, opt=1, max=1)} if shapes.logit_positions else {}
        prefill = {"batch": shapes.batch, "sequence": seq, "past_sequence": Range(min=0, opt=0, max=past.max),
                   "total_sequence": Range(min=1, opt=seq.opt, max=total.max)}
        plans = [
            ("prefill", {**prefill, **one}),
            ("decode", {"batch": shapes.batch, "sequence": Range(min=1, opt=1, max=1),
                        "past_sequence": Range(min=0, opt=past.opt, max=past.max),
                        "total_sequence": Range(min=1, opt=min(past.opt + 1, total.max), max=total.max), **one}),
        ]
        if one:
            assert shapes.logit_positions is not None
            rows = min(PROMPT_LOGPROBS_BATCH, shapes.batch.max)
            plans.append(("prompt_logprobs", {**prefill, "batch": Range(min=1, opt=1, max=rows),
                                              "logit_positions": shapes.logit_positions.model_copy(
                                                  update={"opt": seq.opt})}))
    profiles = []
    for name, ranges in plans:
        inputs = {}
        for spec in io.inputs:
            inputs[spec.name] = {point: [getattr(ranges[d], point) if isinstance(d, str) else d for d in spec.shape]
                                 for point in ("min", "opt", "max")}
        profiles.append(Profile(name=name, ranges=ranges, inputs=inputs))
    return profiles


def expected_dtypes(onnx_path: Path) -> dict[str, str]:
    """Each node's float output type in the graph (the truth a strongly typed network must follow)."""
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory(prefix="trtserve-shapes-") as scratch:  # by path: a graph past 2 GB
        inferred = Path(scratch) / "inferred.onnx"
        onnx.shape_inference.infer_shapes_path(str(onnx_path), str(inferred))
        model = onnx.load(str(inferred), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in (*model.graph.value_info, *model.graph.output)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    expected = {}
    for node in model.graph.node:
        if node.output and types.get(node.output[0]) in FLOAT_TYPES:
            expected[node.name] = FLOAT_TYPES[types[node.output[0]]]
    return expected


QUANTIZED_TYPES = {3: "INT8", 22: "INT4", 21: "UINT4", 2: "UINT8"}  # ONNX TensorProto element types


def expected_quantized(onnx_path: Path) -> dict[str, int]:
    """How many DequantizeLinear nodes read a weight of each integer type (the graph's quantized GEMMs)."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    types = {t.name: t.data_type for t in model.graph.initializer}
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and types.get(node.input[0]) in QUANTIZED_TYPES:
            kind = QUANTIZED_TYPES[types[node.input[0]]]
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def quantized_layers(network) -> dict[str, int]:
    """How many DEQUANTIZE layers of a parsed network read each integer type."""
    counts: dict[str, int] = {}
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type.name == "DEQUANTIZE":
            kind = layer.get_input(0).dtype.name
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def layer_table(network) -> list[tuple[str, str, str]]:
    """(layer name, layer type, first output's dtype) for every layer of a parsed network."""
    rows = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        rows.append((layer.name, layer.type.name, layer.get_output(0).dtype.name))
    return rows


def check_precision(layers: list[tuple[str, str, str]], expected: dict[str, str]) -> dict:
    """Compare layer output types with the graph's. The parser names layers after their ONNX node
    (sub-layers get a `_<n>` suffix); a layer whose node is fp32 in the graph but HALF here is a
    violation."""
    by_type: dict[str, dict[str, int]] = {}
    violations, matched = [], 0
    for name, kind, dtype in layers:
        if dtype in ("FLOAT", "HALF", "BF16"):
            by_type.setdefault(kind, {}).setdefault(dtype, 0)
            by_type[kind][dtype] += 1
        node = name if name in expected else re.sub(r"_\d+$", "", name)
        if node not in expected or dtype not in ("FLOAT", "HALF", "BF16"):
            continue
        matched += 1
        if expected[node] == "FLOAT" and dtype != "FLOAT":
            violations.append(f"{name} ({kind}) is {dtype}; node {node} is fp32 in the graph")
    return {"layers": len(layers), "matched_to_nodes": matched, "float_outputs_by_layer_type": by_type,
            "violations": violations}


def build_trt(onnx_path: Path, out_dir: Path, manifest, options: TrtOptions = TrtOptions()) -> dict:
    """Build `out_dir/model.plan` from the mixed ONNX graph; return the manifest's `tensorrt` entry.
    `manifest`: the engine's so far (its model, io and shapes are read)."""
    from trtserve.engine_dir import as_manifest
    from trtserve.runtime.trt_lib import flavour_of, load_tensorrt, logger

    trt, flavour = load_tensorrt()
    log = logger(trt, keep_verbose=True)  # the verbose build log lists the kernels the plan really runs
    started = time.time()
    builder = trt.Builder(log)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [parser.get_error(i).desc() for i in range(parser.num_errors)]
        raise TrtServeError(f"TensorRT could not parse {onnx_path.name}: {'; '.join(errors[:3])}")
    check = check_precision(layer_table(network), expected_dtypes(onnx_path))
    check["quantized_weights"] = quantized_layers(network)
    wanted = expected_quantized(onnx_path)
    if check["quantized_weights"] != wanted:
        check["violations"].append(f"quantized weights in TensorRT {check['quantized_weights']}; in the graph {wanted}")
    if check["violations"]:
        raise TrtServeError(
            f"{len(check['violations'])} layer(s) that differ in type from the graph in TensorRT, e.g. "
            f"{check['violations'][0]}; nothing was written. Rebuild with --precision fp32, or report the graph")
    config = builder.create_builder_config()
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if options.workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, options.workspace_mib << 20)
    manifest = as_manifest(manifest)
    profiles = profiles_for(manifest.model.kind, manifest.shapes, manifest.io)
    for profile in profiles:
        opt = builder.create_optimization_profile()
        for name, shape in profile.inputs.items():
            opt.set_shape(name, shape["min"], shape["opt"], shape["max"])
        config.add_optimization_profile(opt)
    targets = _set_targets(trt, flavour, config, options)
    cache = _TimingCache(trt, flavour, config, options)
    say(f"tensorrt: building the {flavour} {trt.__version__} plan ({len(profiles)} profile(s), {targets}) ...")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TrtServeError("TensorRT could not build the engine: "
                            + ("; ".join(log.errors()[:3]) or "no error was logged"))
    (out_dir / PLAN).write_bytes(memoryview(plan))
    cache_record = cache.save()
    seconds = round(time.time() - started, 1)
    say(f"tensorrt: {PLAN} {(out_dir / PLAN).stat().st_size / 1e6:.1f} MB in {seconds} s")
    return {
        "name": "tensorrt",
        "flavour": flavour_of(trt),
        "version": trt.__version__,
        "plan": PLAN,
        "plan_sha256": sha256_file(out_dir / PLAN),
        "strongly_typed": True,
        "profiles": [profile.model_dump() for profile in profiles],
        "io": _network_io(network),
        "compute_capability": targets,
        "workspace_mib": options.workspace_mib,
        "version_compatible": options.version_compatible,
        "hardware_compatibility": options.hardware_compatibility,
        "timing_cache": cache_record,
        "layer_precision": check,
        "kernels": kernel_summary([m for _, m in log.messages]),
        "build_seconds": seconds,
        "warnings": [m for s, m in log.messages if s == "WARNING"][:20],
    }


def kernel_summary(messages: list[str]) -> dict:
    """What the built plan runs, from the DETAILED build log: kernels by type with their output
    datatypes (after fusion, e.g. softmax folded into half-precision attention kernels), and the
    activation and weight memory TensorRT reported."""
    by_type: dict[str, dict[str, int]] = {}
    memory, count = {}, 0
    for message in messages:
        for key in ("Total Activation Memory", "Total Weights Memory"):
            found = re.match(rf"{key}: (\d+) bytes", message)
            if found:
                memory[key.lower().replace("total ", "").replace(" ", "_") + "_bytes"] = int(found.group(1))
        if not message.startswith("Layers:"):
            continue
        for line in message.splitlines()[1:]:
            kind = re.search(r"LayerType: (\w+)", line)
            if not kind:
                continue
            count += 1
            outputs = line.split("Outputs: [", 1)[1] if "Outputs: [" in line else ""
            dtypes = set(re.findall(r"Datatype: (\w+)", outputs.split("], TacticName", 1)[0])) or {"none"}
            counts = by_type.setdefault(kind.group(1), {})
            for dtype in dtypes:
                counts[dtype] = counts.get(dtype, 0) + 1
    return {"count": count, "output_dtypes_by_kernel_type": by_type,
            **memory}


def _network_io(network) -> dict:
    def spec(t):
        return {"name": t.name, "dtype": t.dtype.name, "shape": list(t.shape)}

    return {"inputs": [spec(network.get_input(i)) for i in range(network.num_inputs)],
            "outputs": [spec(network.get_output(i)) for i in range(network.num_outputs)]}


def _set_targets(trt, flavour: str, config, options: TrtOptions) -> str:
    """Record (and for TensorRT-RTX, set) which GPUs the plan is for."""
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    if flavour == "tensorrt_rtx":
        if not options.compute_capabilities:
            return "portable (TensorRT-RTX: SM75, SM80, SM86, SM89, SM120, SM121)"
        config.num_compute_capabilities = len(options.compute_capabilities)
        for i, member in enumerate(rtx_targets(trt, options.compute_capabilities)):
            config.set_compute_capability(member, i)
        return "sm" + ",sm".join(c.replace(".", "") for c in options.compute_capabilities)
    level = options.hardware_compatibility.upper()
    if level != "NONE":
        config.hardware_compatibility_level = getattr(trt.HardwareCompatibilityLevel, level)
        return f"hardware compatibility {level.lower()}"
    from trtserve.runtime.devices import cuda_device_info

    devices = cuda_device_info()
    return f"sm{devices[0]['compute_capability'].replace('.', '')}" if devices else "the build machine's GPU"


def rtx_targets(trt, capabilities: tuple[str, ...]) -> list:
    """TensorRT-RTX ComputeCapability members for "8.6"-style strings, or a clear error."""
    members = []
    for cc in capabilities:
        name = "SM" + cc.replace(".", "")
        if not hasattr(trt.ComputeCapability, name):
            raise TrtServeError(f"TensorRT-RTX cannot target compute capability {cc}; it supports "
                                + ", ".join(m for m in trt.ComputeCapability.__members__ if m.startswith("SM")))
        members.append(getattr(trt.ComputeCapability, name))
    return members


class _TimingCache:
    """A persistent timing cache for full TensorRT (TensorRT-RTX keeps the calls as no-ops)."""

    def __init__(self, trt, flavour: str, config, options: TrtOptions):
        from trtserve.fileio import cache_root

        self.config, self.used = config, flavour == "tensorrt"
        self.path = options.timing_cache or cache_root() / "tensorrt" / f"timing-{flavour}-{trt.__version__}.cache"
        self.loaded = 0
        if not self.used:
            return
        blob = self.path.read_bytes() if self.path.is_file() else b""
        self.loaded = len(blob)
        cache = config.create_timing_cache(blob)
        config.set_timing_cache(cache, ignore_mismatch=False)

    def save(self) -> dict:
        if not self.used:
            return {"used": False, "why": "TensorRT-RTX: timing-cache calls are no-ops"}
        blob = bytes(memoryview(self.config.get_timing_cache().serialize()))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(blob)
        tmp.replace(self.path)
        return {"used": True, "path": str(self.path), "bytes_before": self.loaded, "bytes_after": len(blob)}
