"""How an encoder checkpoint turns token states into one vector, read from its sentence-transformers files.

modules.json lists the modules after the transformer: Pooling (1_Pooling/config.json: cls, max, mean,
mean_sqrt_len, weightedmean, lasttoken, concatenated in that order when several are set), Dense layers
(N_Dense/config.json + weights) and Normalize. config_sentence_transformers.json names prompts a request may
ask for by name. A folder without modules.json keeps trtserve's default (mean pooling, normalized) and says
so. The exported graph computes all of it (models/wrappers.py), so every backend returns the same vector;
`pool` here is the numpy reference the fidelity runs and tests compare against.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trtserve.errors import ModelSourceError

MODES = ("cls", "max", "mean", "mean_sqrt_len", "weightedmean", "lasttoken")  # sentence-transformers' order
ACTIVATIONS = {  # a Dense module's activation_function -> the name the graph applies
    "torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.activation.ReLU": "relu", "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.GELU": "gelu",
}
SKIPPED_MODULES = ("sentence_transformers.models.Transformer",)
DEFAULT_SOURCE = "default: no sentence-transformers modules.json (mean pooling, normalized)"


@dataclass(frozen=True)
class Dense:
    path: str  # the module's folder in the checkpoint
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a value of ACTIVATIONS


@dataclass(frozen=True)
class Pooling:
    modes: tuple[str, ...]
    normalize: bool
    dense: tuple[Dense, ...] = ()
    source: str = DEFAULT_SOURCE
    prompts: dict = field(default_factory=dict)  # prompt name -> text put before the input
    default_prompt_name: str | None = None
    folders: tuple[str, ...] = ()  # the modules' folders in the checkpoint (part of its content hash)

    def dimensions(self, hidden_size: int) -> int:
        return self.dense[-1].out_features if self.dense else hidden_size * len(self.modes)

    def to_json(self, hidden_size: int) -> dict:
        return {**asdict(self), "modes": list(self.modes), "dense": [asdict(d) for d in self.dense],
                "folders": list(self.folders), "dimensions": self.dimensions(hidden_size)}


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSourceError(f"{path} could not be read as JSON ({exc}); restore it from the checkpoint") from None


def read_pooling(path: Path) -> Pooling:
    """The checkpoint's pooling; a ModelSourceError names a module or option trtserve does not compute."""
    path = Path(path)
    prompts, default_prompt = _prompts(path)
    if not (path / "modules.json").is_file():
        return Pooling(("mean",), True, prompts=prompts, default_prompt_name=default_prompt)
    modes, normalize, dense, folders = None, False, [], []
    for module in _json(path / "modules.json"):
        kind = str(module.get("type", ""))
        folder = path / str(module.get("path", ""))
        if kind in SKIPPED_MODULES:
            continue
        if module.get("path") and folder.is_dir():
            folders.append(str(module["path"]))
        if kind.endswith((".Pooling", ".Dense")) and not (folder / "config.json").is_file():
            raise ModelSourceError(f"{path / 'modules.json'} lists {module.get('path')}, but "
                                   f"{folder / 'config.json'} is missing: copy the checkpoint with its module folders")
        if kind.endswith(".Pooling"):
            modes = _modes(folder / "config.json")
        elif kind.endswith(".Dense"):
            dense.append(_dense(folder, str(module.get("path", ""))))
        elif kind.endswith(".Normalize"):
            normalize = True
        else:
            raise ModelSourceError(f"{path / 'modules.json'} lists a {kind} module, which trtserve does not "
                                   "compute (supported: Transformer, Pooling, Dense, Normalize)")
    if modes is None:
        raise ModelSourceError(f"{path / 'modules.json'} has no Pooling module: the vector cannot be formed")
    return Pooling(tuple(modes), normalize, tuple(dense), "sentence-transformers modules.json", prompts,
                   default_prompt, tuple(folders))


KEYS = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens", "mean": "pooling_mode_mean_tokens",
        "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens", "weightedmean": "pooling_mode_weightedmean_tokens",
        "lasttoken": "pooling_mode_lasttoken"}


def _modes(config_path: Path) -> list[str]:
    config = _json(config_path)
    if config.get("include_prompt") is False:
        raise ModelSourceError(f"{config_path}: include_prompt false (pooling without the prompt's tokens) is not "
                               "supported")
    modes = [m for m in MODES if config.get(KEYS[m])]
    if not modes:
        raise ModelSourceError(f"{config_path} sets no pooling mode ({', '.join(KEYS.values())})")
    return modes


def _dense(folder: Path, relative: str) -> Dense:
    config = _json(folder / "config.json")
    activation = ACTIVATIONS.get(config.get("activation_function", "torch.nn.modules.linear.Identity"))
    if activation is None:
        raise ModelSourceError(f"{folder / 'config.json'}: activation {config.get('activation_function')!r} is not "
                               f"supported ({', '.join(sorted(ACTIVATIONS))})")
    return Dense(relative, int(config["in_features"]), int(config["out_features"]), bool(config.get("bias", True)),
                 activation)


def _prompts(path: Path) -> tuple[dict, str | None]:
    file = path / "config_sentence_transformers.json"
    if not file.is_file():
        return {}, None
    config = _json(file)
    prompts = {str(k): str(v) for k, v in (config.get("prompts") or {}).items()}
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelSourceError(f"{file}: default_prompt_name {default!r} is not one of its prompts")
    return prompts, default


def dense_weights(path: Path, dense: Dense) -> tuple[np.ndarray, np.ndarray | None]:
    """(weight (out, in), bias (out,) or None) of one Dense module, from its safetensors or torch file."""
    folder = Path(path) / dense.path
    if (folder / "model.safetensors").is_file():
        from safetensors.numpy import load_file

        state = load_file(str(folder / "model.safetensors"))
    elif (folder / "pytorch_model.bin").is_file():
        import torch

        state = {k: v.numpy() for k, v in torch.load(folder / "pytorch_model.bin", weights_only=True).items()}
    else:
        raise ModelSourceError(f"{folder} has no model.safetensors or pytorch_model.bin for its Dense module")
    weight = state.get("linear.weight")
    if weight is None or weight.shape != (dense.out_features, dense.in_features):
        raise ModelSourceError(f"{folder}: linear.weight is missing or not ({dense.out_features}, {dense.in_features})")
    return weight.astype(np.float32), (state["linear.bias"].astype(np.float32) if dense.bias else None)


def from_manifest(entry) -> Pooling:
    """The Pooling an engine manifest's `pooling` section records."""
    return Pooling(tuple(entry.modes), entry.normalize, tuple(Dense(**d.model_dump()) for d in entry.dense),
                   entry.source, dict(entry.prompts), entry.default_prompt_name, tuple(entry.folders))


def load_dense(path: Path, pooling: Pooling | None) -> list:
    """Every Dense module's (weight, bias), in order."""
    return [dense_weights(path, d) for d in pooling.dense] if pooling else []


def pool(pooling: Pooling, hidden: np.ndarray, mask: np.ndarray, dense: list | None = None) -> np.ndarray:
    """The reference in numpy (float64): hidden (B, S, H), mask (B, S) -> (B, D), as sentence-transformers
    computes it. `dense`: the Dense modules' (weight, bias) pairs."""
    h, m = hidden.astype(np.float64), mask.astype(np.float64)[..., None]
    counts = np.maximum(m.sum(1), 1e-9)
    parts = []
    for mode in pooling.modes:
        if mode == "cls":
            parts.append(h[:, 0])
        elif mode == "max":
            parts.append(np.where(m > 0, h, -1e9).max(1))
        elif mode == "mean":
            parts.append((h * m).sum(1) / counts)
        elif mode == "mean_sqrt_len":
            parts.append((h * m).sum(1) / np.sqrt(counts))
        elif mode == "weightedmean":
            w = m * np.arange(1, h.shape[1] + 1, dtype=np.float64)[None, :, None]
            parts.append((h * w).sum(1) / np.maximum(w.sum(1), 1e-9))
        else:  # lasttoken: the last position the mask keeps (left or right padding)
            last = (mask * np.arange(mask.shape[1])[None]).argmax(1)
            parts.append(h[np.arange(h.shape[0]), last])
    out = np.concatenate(parts, axis=1)
    for (weight, bias), module in zip(dense or [], pooling.dense):
        out = out @ weight.astype(np.float64).T + (0 if bias is None else bias)
        # the ignore: mypy joins a ufunc and lambdas to object, which it cannot call
        out = {"identity": lambda x: x, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0),  # type: ignore[operator]
               "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
               "gelu": lambda x: 0.5 * x * (1 + _erf(x / np.sqrt(2)))}[module.activation](out)
    if pooling.normalize:
        out = out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
    return out


def _erf(x: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf)(x)
