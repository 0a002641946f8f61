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
    """Next-token perplexity of (B, S, V) logits on (B, S) ids, counting targets where mask is 1 (one
    row at a time in float64)."""
    nll = []
    for row in range(logits.shape[0]):
        valid = (mask[row, 1:] * mask[row, :-1]).astype(bool)
        nll.append(next_token_nll(logits[row, :-1][valid], input_ids[row, 1:][valid]))
    return float(np.exp(np.concatenate(nll).mean()))


BLOCK_BYTES = 1 << 25  # float64 values of one block of rows (32 MiB): its temporaries are a few times that


def block_rows(width: int, most: int = 256) -> int:
    """Rows of `width` values per float64 block: 256 at a hidden size, 27 at a 151,936-token vocabulary."""
    return max(1, min(most, BLOCK_BYTES // (8 * max(width, 1))))


def compare(ref: np.ndarray, out: np.ndarray, rows: int | None = None) -> dict:
    """The metrics every tensor comparison reports, in one pass over blocks of rows of the last axis (float64
    per block of `block_rows`: a whole [tokens, vocab] pair in float64 would take gigabytes)."""
    tally = Tally()
    tally.add(ref, out, rows)
    return tally.result()


class Tally:
    """`compare`'s metrics over rows that arrive a chunk at a time (logits of a long sequence are never held
    whole: vocabulary x length x rows of them is gigabytes at 262k tokens)."""

    def __init__(self):
        self.worst, self.dot, self.sq_a, self.sq_b, self.peak = 1.0, 0.0, 0.0, 0.0, 0.0
        self.finite, self.equal, self.nonfinite = True, True, 0

    def add(self, ref: np.ndarray, out: np.ndarray, rows: int | None = None) -> None:
        a_all = ref.reshape(-1, ref.shape[-1]) if ref.ndim else ref.reshape(1, 1)
        b_all = out.reshape(-1, out.shape[-1]) if out.ndim else out.reshape(1, 1)
        rows = rows or block_rows(a_all.shape[1])
        self.nonfinite += nonfinite_count(out)
        for start in range(0, a_all.shape[0], rows):
            a, b = a_all[start:start + rows].astype(np.float64), b_all[start:start + rows].astype(np.float64)
            self.finite = self.finite and bool(np.isfinite(b).all())
            self.equal = self.equal and bool(np.array_equal(a, b))
            with np.errstate(invalid="ignore", over="ignore"):
                if a.size:  # NaN where any difference is NaN
                    self.peak = float(np.max([self.peak, np.max(np.abs(a - b))]))
                self.dot += float((a * b).sum())
                self.sq_a, self.sq_b = self.sq_a + float((a * a).sum()), self.sq_b + float((b * b).sum())
            norm_a, norm_b = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
            denom = norm_a * norm_b
            both_zero = (norm_a == 0) & (norm_b == 0)
            cos = np.where(denom > 0, (a * b).sum(1) / np.where(denom > 0, denom, 1), np.where(both_zero, 1.0, 0.0))
            self.worst = min(self.worst, float(cos.min())) if cos.size else self.worst

    def result(self) -> dict:
        denom = np.sqrt(self.sq_a) * np.sqrt(self.sq_b)
        return {
            "max_abs_error": self.peak,
            "cosine": float(self.dot / denom) if denom else float(self.equal),
            "worst_row_cosine": self.worst if self.finite else float("nan"),
            "nonfinite": self.nonfinite,
        }


def next_token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log softmax(logits)[target] per row of (N, V) logits, in float64 a row block at a time."""
    out = np.empty(len(targets), np.float64)
    rows = block_rows(logits.shape[-1])
    for start in range(0, len(targets), rows):
        x = logits[start:start + rows].astype(np.float64)
        top = x.max(-1, keepdims=True)
        log_z = np.log(np.exp(x - top).sum(-1)) + top[..., 0]
        out[start:start + rows] = log_z - np.take_along_axis(x, targets[start:start + rows, None], -1)[..., 0]
    return out
