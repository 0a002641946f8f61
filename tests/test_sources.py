"""MODEL arguments: bundled names, local checkpoints, and what is wrong with bad ones."""

import json
import shutil

import pytest

from tests.conftest import require_package
from trtserve.errors import ModelSourceError
from trtserve.models.sources import check_safetensors, resolve


def copy_checkpoint(src, dst, skip=()):
    dst.mkdir()
    for file in src.iterdir():
        if file.is_file() and file.name not in skip:
            shutil.copyfile(file, dst / file.name)
        elif file.is_dir() and file.name not in skip:  # sentence-transformers' module folders (1_Pooling)
            shutil.copytree(file, dst / file.name)
    return dst


def test_bundled_minilm_resolves_from_its_package(minilm_dir):
    source = resolve("all-MiniLM-L6-v2")
    assert (source.model_id, source.info.family, source.info.num_layers) == ("all-MiniLM-L6-v2", "bert", 6)


def test_local_checkpoint_directory(minilm_dir, tmp_path):
    source = resolve(str(copy_checkpoint(minilm_dir, tmp_path / "mini")))
    assert source.model_id == "mini" and source.info.hidden_size == 384


def test_a_module_folder_missing_from_a_copy_is_named(minilm_dir, tmp_path):
    with pytest.raises(ModelSourceError, match="modules.json lists 1_Pooling, but .*1_Pooling/config.json is missing"):
        resolve(str(copy_checkpoint(minilm_dir, tmp_path / "mini", skip=("1_Pooling",))))


def test_missing_path_names_the_bundled_models(tmp_path):
    with pytest.raises(ModelSourceError, match="does not exist.*all-MiniLM-L6-v2, SmolLM2-135M-Instruct"):
        resolve(str(tmp_path / "nope"))


def test_file_instead_of_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="is a file: give the checkpoint directory"):
        resolve(str(tmp_path / "config.json"))


def test_missing_tokenizer(minilm_dir, tmp_path):
    bad = copy_checkpoint(minilm_dir, tmp_path / "m", skip=("tokenizer.json", "vocab.txt"))
    with pytest.raises(ModelSourceError, match="has no tokenizer"):
        resolve(str(bad))


def test_missing_weights(minilm_dir, tmp_path):
    bad = copy_checkpoint(minilm_dir, tmp_path / "m", skip=("model.safetensors",))
    with pytest.raises(ModelSourceError, match="has no weights"):
        resolve(str(bad))


def test_truncated_and_garbage_safetensors(tmp_path):
    require_package("safetensors", "pip install safetensors")
    import numpy as np
    from safetensors.numpy import save_file

    good = tmp_path / "good.safetensors"
    save_file({"w": np.ones((64, 64), np.float32)}, str(good))
    check_safetensors(good)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(ModelSourceError, match="header describes .* corrupt or truncated"):
        check_safetensors(truncated)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 4096)
    with pytest.raises(ModelSourceError, match="not a readable safetensors file"):
        check_safetensors(garbage)


def test_unsupported_architecture_in_a_checkpoint(minilm_dir, tmp_path):
    bad = copy_checkpoint(minilm_dir, tmp_path / "m")
    config = json.loads((bad / "config.json").read_text())
    config["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match="unsupported architecture model_type='gpt_neox'"):
        resolve(str(bad))
