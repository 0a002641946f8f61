import json

import pytest

from trtserve.errors import ModelSourceError
from trtserve.models.family import detect, read_config

LLAMA = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
    "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
}


def test_llama_is_a_decoder_with_grouped_kv_heads():
    info = detect(LLAMA)
    assert (info.family, info.kind, info.num_kv_heads, info.head_dim) == ("llama", "decoder", 3, 64)


def test_bert_defaults_kv_heads_to_heads():
    info = detect({"model_type": "bert", "num_hidden_layers": 6, "hidden_size": 384, "num_attention_heads": 12,
                   "vocab_size": 30522, "max_position_embeddings": 512})
    assert (info.kind, info.num_kv_heads, info.head_dim, info.max_positions) == ("encoder", 12, 32, 512)


def test_unsupported_architecture_lists_supported_ones():
    with pytest.raises(ModelSourceError, match=r"model_type='t5'.*supported model types: bert, gemma2, gemma3_text, "
                                               r"llama, mistral, phi3, qwen2, qwen3, roberta, xlm-roberta"):
        detect({"model_type": "t5", "architectures": ["T5Model"]})


def test_each_family_is_one_module_named_for_it():
    import pkgutil

    from trtserve.models import families

    modules = {m.name for m in pkgutil.iter_modules(families.__path__)}
    assert modules == {f.name for f in families.BY_MODEL_TYPE.values()}
    assert all(f.kind in ("encoder", "decoder") for f in families.BY_MODEL_TYPE.values())


def _config(model_type: str, **fields) -> dict:
    return {**LLAMA, "num_hidden_layers": 6, "model_type": model_type, **fields}


@pytest.mark.parametrize("model_type, fields, windows", [
    ("mistral", {"sliding_window": 4096}, (4096,) * 6),
    ("mistral", {"sliding_window": None}, None),
    ("phi3", {"sliding_window": 2047}, (2047,) * 6),
    ("qwen2", {"sliding_window": 4096, "use_sliding_window": False}, None),
    ("qwen2", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 4}, (None,) * 4 + (32, 32)),
    ("qwen3", {"sliding_window": 32, "use_sliding_window": True, "max_window_layers": 0}, (32,) * 6),
    ("gemma2", {"sliding_window": 4096}, (4096, None) * 3),  # no layer_types: transformers' alternation
    ("gemma3_text", {"sliding_window": 512}, (512,) * 5 + (None,)),  # five local layers, then a global one
    ("gemma3_text", {"sliding_window": 512, "layer_types": ["full_attention"] * 6}, None),
])
def test_sliding_windows_per_layer_follow_transformers_defaults(model_type, fields, windows):
    assert detect(_config(model_type, **fields)).sliding_windows == windows


def test_roberta_positions_start_after_the_padding_index():
    config = {**LLAMA, "model_type": "xlm-roberta", "max_position_embeddings": 514, "pad_token_id": 1}
    assert detect(config).max_positions == 512  # ids 2..513 of the 514-row table


def test_soft_caps_are_read_where_the_family_has_them():
    info = detect(_config("gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0))
    assert (info.attn_softcap, info.final_softcap) == (50.0, 30.0)
    assert detect(_config("llama", attn_logit_softcapping=50.0)).attn_softcap is None


@pytest.mark.parametrize("model_type, rope, ok", [
    ("llama", {"rope_type": "llama3", "factor": 8.0}, True),
    ("llama", {"type": "linear", "factor": 2.0}, True),
    ("llama", {"rope_type": "yarn", "factor": 4.0}, False),
    ("phi3", {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, True),
    ("mistral", {"rope_type": "llama3"}, False),
])
def test_rope_variants_are_accepted_or_refused_by_name(model_type, rope, ok):
    config = _config(model_type, rope_scaling=rope)
    if ok:
        detect(config)
    else:
        kind = rope.get("rope_type") or rope.get("type")
        with pytest.raises(ModelSourceError, match=f"rope type '{kind}' is not supported"):
            detect(config)


def test_config_errors_name_the_file(tmp_path):
    with pytest.raises(ModelSourceError, match="has no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json is not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_config(tmp_path)["model_type"] == "llama"
