"""Load a checkpoint into torch fp32 with trtserve's attention function."""

from __future__ import annotations

import logging
import os
import warnings

from trtserve.errors import ModelSourceError
from trtserve.models.sources import ModelSource


def quiet_libraries() -> None:
    """Keep transformers' and the exporter's progress bars and notices out of trtserve's output."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"torch\.onnx.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"(torch|transformers).*")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch|transformers|copyreg).*")


def load_torch_model(source: ModelSource, attention: str | None = None):
    """fp32, eval mode. `attention=None` uses trtserve's exported attention; "eager" gives HF's own."""
    quiet_libraries()
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    from trtserve.engine_dir.kinds import ModelKind
    from trtserve.models import attention as attn

    impl = attention or attn.register()
    cls = {ModelKind.DECODER: AutoModelForCausalLM,
           ModelKind.SCORER: AutoModelForSequenceClassification}.get(source.info.kind, AutoModel)
    try:
        model = _streamed(cls, source, impl) or cls.from_pretrained(source.path, dtype=torch.float32,
                                                                    attn_implementation=impl)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"could not load the weights in {source.path}: {first}") from None
    return model.eval()


SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _streamed(cls, source: ModelSource, impl: str):
    """The fp32 model filled a tensor at a time from the checkpoint's safetensors files, each tensor read (not
    mapped) and converted on its own: the peak is the fp32 model plus one tensor. `from_pretrained` maps the files
    and keeps them mapped beside the fp32 copy, so a bf16 checkpoint's bytes are resident with it. None where this
    path does not apply (a quantized checkpoint, names that need transformers' renaming, a tensor type it does not
    read): from_pretrained then."""
    import torch
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights

    files = sorted(source.path.glob("*.safetensors"))
    if not files or "quantization_config" in source.config:
        return None
    stored = {}
    for file in files:
        header, start = _safetensors_header(file)
        stored.update({name: (file, start, entry) for name, entry in header.items() if name != "__metadata__"})
    if any(entry["dtype"] not in SAFETENSORS_DTYPES for _, _, entry in stored.values()):
        return None
    config = AutoConfig.from_pretrained(source.path)
    with no_init_weights():
        model = cls.from_config(config, dtype=torch.float32, attn_implementation=impl)
    model.tie_weights()  # what from_pretrained ties (an LM head sharing the embedding table) is one tensor here too
    wanted = model.state_dict()
    tied = {name for name in wanted if name not in stored and wanted[name].data_ptr() in
            {wanted[other].data_ptr() for other in stored if other in wanted}}
    if set(stored) != set(wanted) - tied or any(tuple(wanted[n].shape) != tuple(e["shape"]) for n, (_, _, e) in
                                                stored.items()):
        return None
    with torch.no_grad():
        for name, (file, start, entry) in stored.items():
            begin, end = entry["data_offsets"]
            with open(file, "rb") as handle:
                handle.seek(start + begin)
                data = bytearray(handle.read(end - begin))
            dtype = getattr(torch, SAFETENSORS_DTYPES[entry["dtype"]])
            tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            wanted[name].copy_(tensor.reshape(entry["shape"]))
    return model


def _safetensors_header(file) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    import json
    import struct

    with open(file, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(size)), 8 + size


def load_hf_tokenizer(path):
    """The checkpoint's tokenizer through transformers, for the torch reference (serving uses
    runtime.text.load_tokenizer)."""
    quiet_libraries()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"could not load the tokenizer in {path}: {exc}") from None
