"""torch -> ONNX with the dynamo exporter (opset 20), dynamic batch, sequence and past length."""

from __future__ import annotations

import re
from pathlib import Path

from trtserve.engine_dir.kinds import ModelKind
from trtserve.models.sources import ModelSource
from trtserve.models.wrappers import (
    ENCODER_OUTPUTS,
    SCORER_OUTPUTS,
    decoder_input_names,
    decoder_output_names,
    encoder_input_names,
    graph_for,
)

OPSET = 20
# Symbolic dims get readable names in the exported graph (the exporter names them s0, s1, ...).
DIM_NAMES = {"input_ids": ("batch", "sequence"), "attention_mask": ("batch", "total_sequence"),
             "logit_positions": ("logit_positions",)}


def uses_token_types(source: ModelSource) -> bool:
    return int(source.config.get("type_vocab_size") or 0) > 0


def export_onnx(source: ModelSource, model, out: Path) -> tuple[list[str], list[str]]:
    """Write `out` with its weights as external data beside it (graph_files); return (input names, output
    names)."""
    import torch

    if source.info.kind in (ModelKind.ENCODER, ModelKind.SCORER):
        module, args, names, outputs, shapes = _encoder_spec(source, model)
    else:
        _static_dynamic_rope(model)
        module, args, names, outputs, shapes = _decoder_spec(source, model)
    with torch.no_grad():
        torch.onnx.export(
            module,
            args,
            str(out),
            dynamo=True,
            opset_version=OPSET,
            input_names=names,
            output_names=list(outputs),
            dynamic_shapes=shapes,
            external_data=True,
            verbose=False,
        )
    _release_rewriter_graphs()
    _rename_dims(out, past_dims=source.info.kind == ModelKind.DECODER)
    return names, list(outputs)


def _release_rewriter_graphs() -> None:
    """onnxscript's rewrite rules are module-level objects whose pattern matchers keep the last graph they matched
    (`_graph`, `_match`, ...), and that graph's initializers wrap the exported model's own tensors: left alone, the
    whole model outlives the export. Each match sets these afresh, so they are cleared."""
    import gc

    try:
        from onnxscript.rewriter._matcher import PatternMatcher
    except ImportError:  # another onnxscript layout: nothing known to clear
        return
    for obj in gc.get_objects():
        if isinstance(obj, PatternMatcher):
            for name in ("_graph", "_match", "_current_node", "_tracer"):
                if name in vars(obj):
                    setattr(obj, name, None)


def _static_dynamic_rope(model) -> None:
    """`dynamic` rotary scaling recomputes its frequencies once a sequence grows past max_position_embeddings, a
    branch on data the exporter cannot trace. An engine never exceeds that length (build caps --max-seq at it),
    and below it the frequencies are the unscaled ones the module already holds: export it as default rope."""
    for module in model.modules():
        kind = getattr(module, "rope_type", None)
        if isinstance(kind, str) and "dynamic" in kind:
            module.rope_type = "default"
        elif isinstance(kind, dict):
            module.rope_type = {k: "default" if "dynamic" in v else v for k, v in kind.items()}


def _encoder_spec(source: ModelSource, model):
    import torch
    from torch.export import Dim

    names = encoder_input_names(uses_token_types(source))
    batch, seq = 2, 8
    args = [torch.randint(0, 100, (batch, seq)), torch.ones(batch, seq, dtype=torch.int64)]
    if len(names) == 3:
        args.append(torch.zeros(batch, seq, dtype=torch.int64))
    dims = {0: Dim.AUTO, 1: Dim.AUTO}
    shapes = {name: dims for name in ["input_ids", "attention_mask", "token_type_ids"][: len(names)]}
    outputs = SCORER_OUTPUTS if source.info.kind == ModelKind.SCORER else ENCODER_OUTPUTS
    return graph_for(model, source), tuple(args), names, outputs, shapes


def _decoder_spec(source: ModelSource, model):
    import torch
    from torch.export import Dim

    info = source.info
    # Trace with past > 0 so nothing specialises on an empty cache.
    batch, seq, past = 2, 3, 4
    args = [
        torch.randint(0, 100, (batch, seq)),
        torch.ones(batch, past + seq, dtype=torch.int64),
        torch.arange(past, past + seq)[None].repeat(batch, 1),
        torch.tensor([0, seq - 1]),  # two positions, so that nothing specialises on one
    ]
    args += [torch.zeros(batch, info.num_kv_heads, past, info.head_dim) for _ in range(2 * info.num_layers)]
    auto = {0: Dim.AUTO, 1: Dim.AUTO}
    shapes = {
        "input_ids": auto,
        "attention_mask": auto,
        "position_ids": auto,
        "logit_positions": {0: Dim.AUTO},
        # varargs count as one argument: the per-layer shapes are nested in one tuple
        "past": tuple({0: Dim.AUTO, 2: Dim.AUTO} for _ in range(2 * info.num_layers)),
    }
    names = decoder_input_names(info.num_layers)
    return graph_for(model, source), tuple(args), names, decoder_output_names(info.num_layers), shapes


def _rename_dims(path: Path, past_dims: bool) -> None:
    from trtserve.graph_files import load_graph, save_structure

    model = load_graph(path, weights=False)
    mapping: dict[str, str] = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        wanted: tuple[str | None, ...] | None = DIM_NAMES.get(value.name)
        if wanted is None and past_dims and value.name.startswith("past_key_values."):
            wanted = ("batch", None, "past_sequence", None)
        if wanted is None and value.name in ("position_ids", "token_type_ids"):
            wanted = ("batch", "sequence")
        for dim, name in zip(dims, wanted or ()):
            if name and dim.dim_param:
                mapping.setdefault(dim.dim_param, name)
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, sorted(mapping, key=len, reverse=True))) + r")\b")
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_param = pattern.sub(lambda m: mapping[m.group(1)], dim.dim_param)
    save_structure(model, path)
