"""The torch reference read a tensor at a time from safetensors files: the same model as from_pretrained gives,
and from_pretrained itself wherever the names need transformers' renaming."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _checkpoint(path, tied: bool):
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)  # stored in bf16, loaded in fp32
    model.save_pretrained(path)
    return path


def _source(path):
    from trtserve.models.family import detect

    config = json.loads((path / "config.json").read_text())
    return type("Source", (), {"path": path, "config": config, "info": detect(config)})()


@pytest.mark.parametrize("tied", [True, False])
def test_a_streamed_model_equals_from_pretrained(tmp_path, tied):
    from trtserve.models.loading import _streamed

    source = _source(_checkpoint(tmp_path, tied))
    streamed = _streamed(transformers.AutoModelForCausalLM, source, "eager")
    assert streamed is not None
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                  attn_implementation="eager")
    assert all(p.dtype == torch.float32 for p in streamed.parameters())
    assert (streamed.lm_head.weight is streamed.model.embed_tokens.weight) == tied
    ids = torch.tensor([[1, 5, 77, 3, 120]])
    with torch.inference_mode():
        assert torch.equal(streamed.eval()(input_ids=ids).logits, reference.eval()(input_ids=ids).logits)


def test_names_that_differ_from_the_models_leave_loading_to_from_pretrained(tmp_path):
    from safetensors.torch import load_file, save_file

    from trtserve.models.loading import _streamed

    path = _checkpoint(tmp_path, tied=False)
    weights = load_file(path / "model.safetensors")
    # a key the model lacks, which from_pretrained drops
    weights["model.extra.scale"] = torch.ones(4, dtype=torch.bfloat16)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    assert _streamed(transformers.AutoModelForCausalLM, _source(path), "eager") is None
