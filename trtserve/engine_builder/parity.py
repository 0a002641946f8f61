"""Parity of a freshly built engine against HF's own torch fp32 model on real Wikipedia text.

The reference is the checkpoint loaded by transformers with its stock eager attention, its own
mask code and its own KV cache, so the check covers the export wrapper too.
"""

from __future__ import annotations

import numpy as np

from trtserve.eval.data import wiki_paragraphs, wiki_text
from trtserve.precision.fidelity import compare, perplexity, top1_agreement
from trtserve.runtime import generate
from trtserve.runtime.base import Backend

ENCODER_MAX_ABS = 1e-4
DECODER_PPL_REL = 1e-3
DECODE_STEPS = 32


def encoder_parity(backend: Backend, ref_model, tokenizer, max_seq: int) -> dict:
    import torch

    paragraphs = wiki_paragraphs()
    cases = {
        f"batch8_seq{min(128, max_seq)}": (list(paragraphs[:8]), min(128, max_seq)),
        f"batch2_seq{max_seq}": ([wiki_text(2 * max_seq, 8), wiki_text(2 * max_seq, 40)], max_seq),
    }
    names = {spec.name for spec in backend.inputs}
    results = {}
    for label, (texts, length) in cases.items():
        enc = tokenizer(texts, padding=True, truncation=True, max_length=length, return_tensors="np")
        feeds = {k: enc[k].astype(np.int64) for k in names}
        out = backend.infer(feeds)
        with torch.inference_mode():
            ref = ref_model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
        keep = feeds["attention_mask"].astype(bool)
        weights = keep[..., None].astype(np.float64)
        ref_pooled = (ref * weights).sum(1) / weights.sum(1)
        results[label] = {
            "tokens": int(keep.sum()),
            "last_hidden_state": compare(ref[keep], out["last_hidden_state"][keep]),
            "sentence_embedding": compare(ref_pooled, out["sentence_embedding"]),
        }
    worst = max(r[k]["max_abs_error"] for r in results.values() for k in ("last_hidden_state", "sentence_embedding"))
    return {
        "text": "Wikipedia (gensim enwiki sample)",
        "cases": results,
        "max_abs_error": worst,
        "threshold": {"max_abs_error": ENCODER_MAX_ABS},
        "passed": worst <= ENCODER_MAX_ABS,
    }


def decoder_parity(backend: Backend, ref_model, tokenizer, max_seq: int) -> dict:
    prefill = _decoder_prefill(backend, ref_model, tokenizer, min(128, max_seq))
    decode = _decoder_decode(backend, ref_model, tokenizer, min(64, max_seq - DECODE_STEPS))
    passed = (
        prefill["top1_agreement"] == 1.0
        and prefill["perplexity_rel_delta"] <= DECODER_PPL_REL
        and decode["top1_agreement"] == 1.0
    )
    return {
        "text": "Wikipedia (gensim enwiki sample)",
        "prefill": prefill,
        "decode": decode,
        "threshold": {"top1_agreement": 1.0, "perplexity_rel_delta": DECODER_PPL_REL},
        "passed": passed,
    }


def _token_rows(tokenizer, length: int, starts: tuple[int, ...]) -> np.ndarray:
    rows = [tokenizer(wiki_text(2 * length, s), add_special_tokens=False)["input_ids"][:length] for s in starts]
    return np.array(rows, dtype=np.int64)


def _decoder_prefill(backend: Backend, ref_model, tokenizer, length: int) -> dict:
    import torch

    ids = _token_rows(tokenizer, length, (0, 30))
    mask = np.ones_like(ids)
    pad = length // 4
    # Row 1 is left-padded, so the check covers padding masks and per-row positions too.
    ids[1, :pad] = tokenizer.pad_token_id or 0
    mask[1, :pad] = 0
    logits = generate.step(backend, generate.start(backend, 2), ids, mask)
    with torch.inference_mode():
        ref = ref_model(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            position_ids=torch.from_numpy(generate.positions_from_mask(mask)),
        ).logits.numpy()
    keep = mask.astype(bool)
    ppl_ref, ppl_out = perplexity(ref, ids, mask), perplexity(logits, ids, mask)
    return {
        "batch": 2,
        "sequence": length,
        "left_padding_row1": pad,
        "logits": compare(ref[keep], logits[keep]),
        "top1_agreement": top1_agreement(ref[keep], logits[keep]),
        "perplexity_torch": ppl_ref,
        "perplexity_engine": ppl_out,
        "perplexity_rel_delta": abs(ppl_out - ppl_ref) / ppl_ref,
    }


def _decoder_decode(backend: Backend, ref_model, tokenizer, prompt_len: int) -> dict:
    """HF `generate` (greedy, its own KV cache) vs the engine fed the same tokens step by step."""
    import torch

    ids = _token_rows(tokenizer, prompt_len, (60, 90))
    mask = np.ones_like(ids)
    with torch.inference_mode():
        out = ref_model.generate(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy(mask),
            max_new_tokens=DECODE_STEPS,
            min_new_tokens=DECODE_STEPS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id or 0,
        )
    ref_tokens = out.sequences[:, ids.shape[1]:].numpy()
    ref_logits = torch.stack(out.logits, 1).numpy()  # (B, steps, V)
    _, logits = generate.greedy(backend, ids, mask, DECODE_STEPS, forced=ref_tokens)
    free_tokens, _ = generate.greedy(backend, ids, mask, DECODE_STEPS)
    return {
        "batch": 2,
        "prompt": prompt_len,
        "steps": DECODE_STEPS,
        "logits": compare(ref_logits, logits),
        "top1_agreement": top1_agreement(ref_logits, logits),
        "greedy_tokens_identical": bool(np.array_equal(free_tokens, ref_tokens)),
    }
