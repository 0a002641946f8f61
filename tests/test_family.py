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
    with pytest.raises(ModelSourceError, match=r"model_type='t5'.*supported model types: bert, llama"):
        detect({"model_type": "t5", "architectures": ["T5Model"]})


def test_config_errors_name_the_file(tmp_path):
    with pytest.raises(ModelSourceError, match="has no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="config.json is not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert read_config(tmp_path)["model_type"] == "llama"
