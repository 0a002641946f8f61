"""Reading a checkpoint's sentence-transformers modules (models.pooling), the numpy reference pooling, and
the graph's pooling (models.wrappers) against it, on made-up folders and arrays."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trtserve.errors import ModelSourceError
from trtserve.models.pooling import DEFAULT_SOURCE, MODES, Dense, Pooling, load_dense, pool, read_pooling

ST = "sentence_transformers.models."


def _folder(tmp_path, modules, pooling=None, dense=None, prompts=None):
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": ST + kind} for i, (kind, path) in enumerate(modules)]))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 4, **pooling}))
    if dense is not None:
        from safetensors.numpy import save_file

        (tmp_path / "2_Dense").mkdir()
        weight, bias, activation = dense
        (tmp_path / "2_Dense" / "config.json").write_text(json.dumps(
            {"in_features": weight.shape[1], "out_features": weight.shape[0], "bias": bias is not None,
             "activation_function": activation}))
        save_file({"linear.weight": weight, **({"linear.bias": bias} if bias is not None else {})},
                  str(tmp_path / "2_Dense" / "model.safetensors"))
    if prompts is not None:
        (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(prompts))
    return tmp_path


def test_a_plain_transformers_folder_keeps_mean_pooling_normalized_and_says_so(tmp_path):
    pooling = read_pooling(tmp_path)
    assert (pooling.modes, pooling.normalize, pooling.source) == (("mean",), True, DEFAULT_SOURCE)


def test_modules_json_gives_modes_dense_normalize_and_prompts(tmp_path):
    weight = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
    folder = _folder(tmp_path, [("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense"),
                                ("Normalize", "3_Normalize")],
                     pooling={"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False},
                     dense=(weight, None, "torch.nn.modules.activation.Tanh"),
                     prompts={"prompts": {"query": "query: ", "passage": "passage: "}, "default_prompt_name": "query"})
    pooling = read_pooling(folder)
    assert pooling.modes == ("cls",) and pooling.normalize
    assert pooling.dense == (Dense("2_Dense", 4, 3, False, "tanh"),) and pooling.dimensions(4) == 3
    assert pooling.prompts == {"query": "query: ", "passage": "passage: "} and pooling.default_prompt_name == "query"
    assert pooling.folders == ("1_Pooling", "2_Dense")
    (w, b), = load_dense(folder, pooling)
    assert np.array_equal(w, weight) and b is None


@pytest.mark.parametrize("modules, pooling, message", [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("CNN", "2_CNN")], {"pooling_mode_mean_tokens": True},
     "CNN module, which trtserve does not compute"),
    ([("Transformer", ""), ("Normalize", "2_Normalize")], None, "no Pooling module"),
    ([("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": True, "include_prompt": False}, "include_prompt false"),
    ([("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": False}, "sets no pooling mode"),
])
def test_what_the_graph_would_not_compute_is_refused_by_name(tmp_path, modules, pooling, message):
    with pytest.raises(ModelSourceError, match=message):
        read_pooling(_folder(tmp_path, modules, pooling))


def test_a_default_prompt_name_must_be_one_of_the_prompts(tmp_path):
    folder = _folder(tmp_path, [("Pooling", "1_Pooling")], {"pooling_mode_mean_tokens": True},
                     prompts={"prompts": {"query": "q: "}, "default_prompt_name": "document"})
    with pytest.raises(ModelSourceError, match="default_prompt_name 'document'"):
        read_pooling(folder)


def test_the_reference_pools_as_sentence_transformers_does():
    hidden = np.array([[[1.0, 0.0], [3.0, 4.0], [9.0, 9.0]]])  # one row, its third token padding
    mask = np.array([[1, 1, 0]])
    want = {"cls": [1, 0], "max": [3, 4], "mean": [2, 2], "mean_sqrt_len": [4 / np.sqrt(2), 4 / np.sqrt(2)],
            "weightedmean": [(1 + 6) / 3, 8 / 3], "lasttoken": [3, 4]}
    for mode in MODES:
        np.testing.assert_allclose(pool(Pooling((mode,), False), hidden, mask)[0], want[mode])
    both = pool(Pooling(("cls", "mean"), True), hidden, mask)[0]
    np.testing.assert_allclose(both, np.array([1, 0, 2, 2]) / 3)


def test_the_graphs_pooling_equals_the_reference_for_every_mode_with_dense_and_padding():
    torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0) for the graph module")
    from trtserve.models.wrappers import encoder_graph

    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(3, 5, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    weight, bias = rng.normal(size=(3, 8)).astype(np.float32), rng.normal(size=3).astype(np.float32)
    for modes in [(m,) for m in MODES] + [("cls", "mean")]:
        dense = (Dense("2_Dense", 4 * len(modes), 3, True, "tanh"),) if len(modes) == 2 else ()
        pooling = Pooling(modes, normalize=len(modes) == 2, dense=dense)
        weights = [(weight, bias)] if dense else []
        graph = encoder_graph(torch.nn.Identity(), pooling, weights)
        with torch.no_grad():
            got = graph.pool(torch.from_numpy(hidden), torch.from_numpy(mask).bool()).numpy()
        np.testing.assert_allclose(got, pool(pooling, hidden, mask, weights), atol=1e-5, err_msg=str(modes))
