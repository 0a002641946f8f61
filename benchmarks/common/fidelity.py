"""A decoder's fidelity cases and worst figures against reference logits, measured on a torch model (the
activation probes compare modified GEMMs this way before any kernel exists)."""

from __future__ import annotations

import numpy as np


def decoder_cases(tokenizer, corpus, lengths: list[int]) -> list[tuple[str, np.ndarray, np.ndarray, bool]]:
    from trtserve.precision.measure import random_ids

    cases = []
    pad = tokenizer.pad_token_id or 0
    for length in lengths:
        batch = 2 if length <= 512 else 1
        ids = np.array(corpus.rows(tokenizer, batch, length, special=False), np.int64)
        mask = np.ones_like(ids)
        if batch > 1:
            ids[1, : length // 4], mask[1, : length // 4] = pad, 0
        cases.append((f"real b{batch} seq{length}", ids, mask, True))
        rng = np.random.default_rng([1, length])
        ids = random_ids(tokenizer.vocab_size, rng, (1, length))
        cases.append((f"random b1 seq{length}", ids, np.ones_like(ids), False))
    ids = np.array(corpus.rows(tokenizer, 8, 128, special=False), np.int64)
    mask = np.ones_like(ids)
    for row, fraction in zip(range(4, 8), (1 / 8, 1 / 4, 1 / 2, 3 / 4)):
        ids[row, : int(128 * fraction)], mask[row, : int(128 * fraction)] = pad, 0
    cases.append(("real b8 seq128, 4 rows padded", ids, mask, True))
    return cases


def decoder_logits(model, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    import torch

    from trtserve.runtime.generate import positions_from_mask

    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     position_ids=torch.from_numpy(positions_from_mask(mask))).logits.numpy()


def worst_over(model, cases, reference: dict) -> tuple[float, float, float, float, float]:
    """The model's worst figures over `cases` against `reference` logits: top-1 and perplexity change (real
    text), worst-token cosine on real text and on random ids, and the whole logits' cosine."""
    from trtserve.precision.measure import logits_case

    top1, ppl, real_cos, random_cos, overall = 1.0, 0.0, 1.0, 1.0, 1.0
    for label, ids, mask, real in cases:
        case = logits_case(reference[label], decoder_logits(model, ids, mask), ids, mask, real)
        overall = min(overall, case["logits"]["cosine"])
        if real:
            top1, ppl = min(top1, case["top1_agreement"]), max(ppl, case["perplexity_rel_delta"])
            real_cos = min(real_cos, case["logits"]["worst_row_cosine"])
        else:
            random_cos = min(random_cos, case["logits"]["worst_row_cosine"])
    return top1, ppl, real_cos, random_cos, overall


def meets_target(t, top1: float, ppl: float, real_cos: float, random_cos: float, overall: float) -> bool:
    return (top1 >= t.min_top1 and ppl <= t.max_ppl_delta and real_cos >= t.min_token_cosine
            and overall >= t.min_cosine and random_cos >= t.random_token_cosine)
