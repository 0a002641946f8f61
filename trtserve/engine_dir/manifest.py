"""The manifest's schema: what an engine directory says about itself, as typed models.

The builder composes the manifest section by section and `seal` validates it here before writing;
everything that opens an engine reads attributes of these models, never string keys. Sections a build
step adds later (the backend's graph, the decode graph, the TensorRT plan, fidelity) are optional, so a
manifest being built validates at every step.

What is typed is the contract between building and serving. Measurement records (fidelity cases, the
precision pass's per-node report, auto's search record, TensorRT's layer check) stay JSON objects: their
shape belongs to the code that measures them (precision/, engine_builder/tensorrt.py), and nothing that
serves an engine reads into them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from trtserve.engine_dir.kinds import ModelKind

Record = dict[str, Any]  # a measurement record: owned by the module that wrote it


class Part(BaseModel):
    """A manifest section: unknown keys are refused (a manifest from a newer schema is not half-read)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Range(Part):
    min: int
    opt: int
    max: int


class Shapes(Part):
    """The range of every named axis the graph's inputs and outputs use."""

    batch: Range
    sequence: Range
    past_sequence: Range | None = None  # decoders
    total_sequence: Range | None = None  # decoders: past + new tokens
    logit_positions: Range | None = None  # decoders: positions whose logits are returned

    def axes(self) -> dict[str, Range]:
        """{axis name: range} of the axes this engine has (the names the graph's dims use)."""
        return {name: value for name, value in self if value is not None}


class Tensor(Part):
    name: str
    dtype: str  # numpy dtype name
    shape: list[int | str]  # ints for fixed axes, axis names (Shapes) for dynamic ones


class IO(Part):
    inputs: list[Tensor]
    outputs: list[Tensor]


class Architecture(Part):
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    family: str | None = None  # a checkpoint's family (models.family); None for parallel-track models
    kind: ModelKind | None = None  # the checkpoint's (models.family.ModelInfo.kind)
    model_type: str | None = None
    intermediate_size: int | None = None  # parallel-track models
    num_labels: int | None = None  # cross-encoders: the classification head's outputs
    sliding_windows: list[int | None] | None = None  # per layer: keys q - w < k <= q; None: full attention
    attn_softcap: float | None = None  # attention scores tanh(s / cap) * cap
    final_softcap: float | None = None  # logits tanh(l / cap) * cap


class Model(Part):
    id: str
    kind: ModelKind
    source: str  # what `trtserve fidelity` resolves again: a bundled name or a path
    architecture: Architecture
    source_path: str | None = None
    source_sha256: str | None = None
    family: str | None = None


class Onnx(Part):
    """The portable graph: the policy written into it, obeyed by every backend."""

    file: str
    sha256: str
    opset: int
    exporter: str
    fp32_export_cache: str


class Precision(Part):
    policy: str  # a name of precision.policy.POLICIES
    weights: str | None = None  # "float" | "gguf" | "int8" | "int4"
    low_precision_type: str | None = None
    fp16_anchor_ops: list[str] = []
    fp32_ops: list[str] = []
    fp32_patterns: list[str] = []
    follow_ops: list[str] = []
    fp32_nodes: list[str] = []
    low_embeddings: bool = False
    graph: Record | None = None  # what the precision pass wrote, per node or per weight
    search: Record | None = None  # how auto chose its fp32 set
    # track engines' quantized weights
    formats: dict[str, int] | None = None
    int8_activations: str | None = None
    int8_activations_missed: list[Record] | None = None
    calibration: Record | None = None
    kept_safer: int | None = None
    kept_safer_by_calibration: int | None = None


class KvGraph(Part):
    """The decode graph over in-place KV buffers (None file: decoding copies the cache, `why_not` says why)."""

    file: str | None
    why_not: str | None = None
    capacity: int | None = None
    check: Record | None = None
    weights: list[str] | None = None  # the weight files it reads (shared with the optimized graph's)


class Backend(Part):
    """ONNX Runtime's optimized graph, the CPU default every engine carries."""

    name: str
    graph: str
    portable_graph: str
    graph_optimization_level: str
    providers: list[str]
    onnxruntime_version: str
    machine: str
    chosen_because: str | None = None
    matmulnbits_accuracy_levels: dict[str, int] | None = None
    int8_activations: str | None = None
    int8_activations_missed: list[Record] | None = None
    weights: str | None = None  # the optimized graph's weight file
    resident_mb: float | None = None
    kv_graph: KvGraph | None = None


class Profile(Part):
    """A TensorRT optimization profile: each axis's range, and each input's min/opt/max shape under it."""

    name: str  # "all" (encoders) | "prefill" | "decode" | "prompt_logprobs"
    ranges: dict[str, Range]
    inputs: dict[str, dict[str, list[int]]]


class TensorRT(Part):
    name: str = "tensorrt"
    flavour: str  # "tensorrt" | "tensorrt_rtx"
    version: str
    plan: str
    compute_capability: Any  # what the plan targets: "sm90", a list of them, or "portable"
    profiles: list[Profile]  # engine_builder.tensorrt.profiles_for
    io: Record
    plan_sha256: str | None = None
    strongly_typed: bool = True
    workspace_mib: int | None = None
    version_compatible: bool = False
    hardware_compatibility: str | None = None
    timing_cache: Record | None = None
    layer_precision: Record | None = None
    kernels: Record | None = None
    build_seconds: float | None = None
    warnings: list[str] = []
    chosen_because: str | None = None


class OpenVino(Part):
    """OpenVINO compiling the portable graph for the CPU (encoders and cross-encoders), each inference precision
    this CPU computes natively measured at the gate and timed against ONNX Runtime's graph on this machine."""

    version: str
    graph: str  # the portable graph it compiles
    inference_precision: str | None  # the precision kept ("bf16" | "f32"); None: none met the target
    chosen: bool  # `auto` serves it: requested with --backend openvino, or met the target and measured faster
    chosen_because: str
    threads: int
    cpu: str  # the CPU the timings were taken on: model name and the flags that decide the kernels
    tried: list[Record]  # per precision: its verdict, worst values, failures, timings against ONNX Runtime


class Fidelity(Part):
    """Measured fidelity against torch fp32 (precision.measure): the verdict, and one record per run."""

    passed: bool
    failures: list[str]
    lengths: list[int]
    text: str
    target: Record  # precision.measure.Target's fields
    reference: str | None = None
    labels: dict[str, str] | None = None
    onnxruntime: Record | None = None
    fp16_emulation: Record | None = None
    openvino: Record | None = None  # the OpenVINO precision kept, where one met the target

    def runs(self) -> dict[str, Record]:
        """{run name: its record} of the runs measured (ONNX Runtime; fp16 emulation where the policy has fp16;
        OpenVINO where the engine carries a precision of it that met the target)."""
        return {name: run for name in ("onnxruntime", "fp16_emulation", "openvino")
                if (run := getattr(self, name)) is not None}


class Parity(Part):
    max_abs_error: float
    against: str
    steps: int | None = None


class Sync(Part):
    op: str
    of: str
    after_segments: list[int]
    per_forward: int


class TrackGraph(Part):
    graph: str
    inputs: list[str]
    outputs: list[str]


class ParallelTracks(Part):
    tracks: int
    block_depth: int
    segments: int
    layers_per_segment: list[list[int]]
    kv_heads_per_track: int
    sync: Sync
    graphs: dict[str, TrackGraph]
    embed: str
    head: str
    segment_graphs: list[list[str]]


class ConfirmGrid(Part):
    grid: str
    label: str
    shapes: int


class DenseModule(Part):
    path: str
    in_features: int
    out_features: int
    bias: bool
    activation: str


class Pooling(Part):
    """An encoder's vector, computed in the graph (models.pooling): modes concatenated, Dense, Normalize."""
    modes: list[str]
    normalize: bool
    dense: list[DenseModule] = []
    source: str
    prompts: dict[str, str] = {}
    default_prompt_name: str | None = None
    folders: list[str] = []
    dimensions: int


class FileEntry(Part):
    size: int
    sha256: str


class Manifest(Part):
    model: Model
    schema_version: int | None = None  # set by write_manifest
    io: IO | None = None
    shapes: Shapes | None = None
    onnx: Onnx | None = None
    precision: Precision | None = None
    backend: Backend | None = None
    tensorrt: TensorRT | None = None
    openvino: OpenVino | None = None
    fidelity: Fidelity | None = None
    parity: Parity | None = None
    parallel_tracks: ParallelTracks | None = None
    confirm_grid: ConfirmGrid | None = None
    pooling: Pooling | None = None  # encoders built since pooling moved into the graph; None: mean, normalized after
    versions: dict[str, str] | None = None
    build_command: str | None = None
    created: str | None = None
    build_seconds: float | None = None
    files: dict[str, FileEntry] = {}

    @property
    def kind(self) -> ModelKind:
        return self.model.kind

    @property
    def kv_graph(self) -> KvGraph | None:
        return self.backend.kv_graph if self.backend else None

    def to_json(self) -> dict[str, Any]:
        """The manifest as written: the keys the builder set, nothing added; measured values as measured (a
        NaN stays NaN, as json writes it, where pydantic's JSON mode would write null)."""
        return self.model_dump(exclude_unset=True)
