"""A decoder's torch reference computed before the engine runs: the logits of its LM head over kept hidden states
equal the whole model's, each input is run once, and only the head is held afterwards."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("cap", [None, 3.0])
def test_the_kept_head_gives_the_models_logits_and_each_input_runs_once(cap):
    from trtserve.precision.reference import Reference

    config = transformers.Gemma2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       final_logit_softcapping=cap, attn_logit_softcapping=None)
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    loads = []

    def load():
        loads.append(1)
        return model

    reference = Reference(load)
    ids = np.random.default_rng(0).integers(0, 96, (2, 20))
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    prompt = ids[:, :6].copy()
    reference.prepare([(ids, mask)], prompt, pad_id=0)
    reference.prepare([(ids, mask)], prompt, pad_id=0)  # cached: nothing runs, nothing is loaded
    assert len(loads) == 1 and reference._model is None
    assert reference._head.weight.dtype == torch.float32  # random fp32 weights: bf16 would round them
    with torch.inference_mode():
        positions = torch.from_numpy(np.clip(np.cumsum(mask, 1) - 1, 0, None))
        whole = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                      position_ids=positions).logits.numpy()
    np.testing.assert_allclose(reference.logits(ids, mask, 0, 20), whole, atol=1e-5)
    np.testing.assert_allclose(reference.logits(ids, mask, 7, 13), whole[:, 7:13], atol=1e-5)
    tokens, logits = reference.decoded(prompt)
    assert tokens.shape == (2, 32) and logits.shape == (2, 32, 96)


def test_a_head_whose_values_are_bf16_is_kept_in_bf16_in_vocabulary_blocks_with_the_same_logits(monkeypatch):
    from trtserve.precision.reference import _KeptHead

    monkeypatch.setattr(_KeptHead, "ROWS", 7)  # blocks that do not divide the vocabulary
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 40, bias=True)
    with torch.no_grad():
        head.weight.copy_(head.weight.to(torch.bfloat16).float())  # a bf16 checkpoint upcast at load
    kept = _KeptHead.of(head)
    assert kept.weight.dtype == torch.bfloat16 and kept.weight.data_ptr() != head.weight.data_ptr()
    hidden = torch.randn(2, 5, 16)
    with torch.inference_mode():
        whole = head(hidden)
    np.testing.assert_allclose(kept(hidden, None), whole.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(kept(hidden, 2.0), (torch.tanh(whole / 2.0) * 2.0).numpy(), rtol=1e-6, atol=1e-6)
