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

    from trtserve.models import attention as attn

    impl = attention or attn.register()
    cls = {"decoder": AutoModelForCausalLM, "scorer": AutoModelForSequenceClassification}.get(source.info.kind, AutoModel)
    try:
        model = cls.from_pretrained(source.path, dtype=torch.float32, attn_implementation=impl)
    except (OSError, ValueError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"could not load the weights in {source.path}: {first}") from None
    return model.eval()


def load_hf_tokenizer(path):
    """The checkpoint's tokenizer through transformers, for the torch reference (serving uses runtime.text.load_tokenizer)."""
    quiet_libraries()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"could not load the tokenizer in {path}: {exc}") from None
