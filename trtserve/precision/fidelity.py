"""Fidelity metrics of a candidate output against the torch fp32 reference (numpy only)."""

from __future__ import annotations

import numpy as np


def max_abs_error(ref: np.ndarray, out: np.ndarray) -> float:
    return float(np.max(np.abs(ref.astype(np.float64) - out.astype(np.float64)))) if ref.size else 0.0


def cosine(ref: np.ndarray, out: np.ndarray) -> float:
    """Cosine similarity of the flattened arrays."""
    a, b = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom else float(np.array_equal(a, b))


def worst_row_cosine(ref: np.ndarray, out: np.ndarray) -> float:
    """Smallest cosine over rows of the last axis (per token for hidden states or logits).

    A row holding NaN or Inf has no cosine: the result is then NaN, never a flattering number."""
    a = ref.astype(np.float64).reshape(-1, ref.shape[-1])
    b = out.astype(np.float64).reshape(-1, out.shape[-1])
    if not np.isfinite(b).all():
        return float("nan")
    denom = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
    cos = np.where(denom > 0, (a * b).sum(1) / np.where(denom > 0, denom, 1), np.where(both_zero, 1.0, 0.0))
    return float(cos.min()) if cos.size else 1.0


def nonfinite_count(out: np.ndarray) -> int:
    return int(np.size(out) - np.count_nonzero(np.isfinite(out)))


def top1_agreement(ref_logits: np.ndarray, out_logits: np.ndarray) -> float:
    """Fraction of positions (rows of the last axis) whose argmax agrees."""
    ref_top = ref_logits.reshape(-1, ref_logits.shape[-1]).argmax(-1)
    out_top = out_logits.reshape(-1, out_logits.shape[-1]).argmax(-1)
    return float(np.mean(ref_top == out_top)) if ref_top.size else 1.0


def perplexity(logits: np.ndarray, input_ids: np.ndarray, mask: np.ndarray) -> float:
    """Next-token perplexity of (B, S, V) logits on (B, S) ids, counting targets where mask is 1."""
    x = logits[:, :-1].astype(np.float64)  # (B, S-1, V)
    targets = input_ids[:, 1:]
    valid = (mask[:, 1:] * mask[:, :-1]).astype(bool)
    top = x.max(-1, keepdims=True)
    log_z = np.log(np.exp(x - top).sum(-1)) + top[..., 0]  # (B, S-1)
    picked = np.take_along_axis(x, targets[..., None], -1)[..., 0]
    nll = (log_z - picked)[valid]
    return float(np.exp(nll.mean()))


def compare(ref: np.ndarray, out: np.ndarray) -> dict:
    """The metrics every tensor comparison reports."""
    return {
        "max_abs_error": max_abs_error(ref, out),
        "cosine": cosine(ref, out),
        "worst_row_cosine": worst_row_cosine(ref, out),
        "nonfinite": nonfinite_count(out),
    }
