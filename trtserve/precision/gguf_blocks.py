"""A GGUF checkpoint's own quantized blocks, read as arrays and matched to the exported graph's weights.

GGUF stores each weight row by row in blocks of 32 along the row (the input dimension of a GEMM):
- Q8_0: an fp16 scale d and 32 int8 values; w = d * q.
- Q4_1: an fp16 scale d, an fp16 minimum m and 32 4-bit values; w = d * q + m.
transformers dequantizes these to fp32 (with gguf-py's own functions) and may reorder rows (the
query and key heads of llama are permuted back), so a graph weight is matched to its GGUF tensor
by the bytes of its dequantized rows, never by name: every row of the graph weight must be a row of
one GGUF tensor, and that row permutation is applied to the blocks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
FORMATS = ("Q8_0", "Q4_1")


@dataclass(frozen=True)
class Blocks:
    """One quantized tensor as arrays: `q` [rows, cols] integers, `scale` and `minimum` [rows, cols/block]
    (GGUF's blocks are 32 values)."""

    name: str
    format: str
    q: np.ndarray  # int8 (Q8_0) or uint8 holding 0..15 (Q4_1)
    scale: np.ndarray  # float32
    minimum: np.ndarray | None  # float32, Q4_1 only

    @property
    def block(self) -> int:
        """Values per block along the input dimension: 32 for GGUF's blocks, more where a policy chose so."""
        return self.q.shape[1] // self.scale.shape[1]

    def dequantized(self, rows_at_once: int = 4096) -> np.ndarray:
        """fp32 values d * q (+ m), computed `rows_at_once` rows at a time into the one array returned."""
        out = np.empty(self.q.shape, np.float32)
        blocks = out.reshape(*self.scale.shape, self.block)
        for first in range(0, len(out), rows_at_once):
            part = slice(first, first + rows_at_once)
            w = blocks[part]
            w[...] = self.q[part].reshape(w.shape)
            np.multiply(w, self.scale[part, :, None], out=w)
            if self.minimum is not None:
                np.add(w, self.minimum[part, :, None], out=w)
        return out

    def rows(self, order: np.ndarray) -> Blocks:
        minimum = None if self.minimum is None else self.minimum[order]
        return Blocks(self.name, self.format, self.q[order], self.scale[order], minimum)


def _unpack(name: str, fmt: str, raw: np.ndarray, rows: int, cols: int) -> Blocks:
    blocks = raw.reshape(rows * cols // BLOCK, -1)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    if fmt == "Q8_0":
        q = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
        return Blocks(name, fmt, q, scale, None)
    minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(rows, -1)
    packed = blocks[:, 4:]  # 16 bytes: elements 0..15 in the low nibbles, 16..31 in the high ones
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).reshape(rows, cols)
    return Blocks(name, fmt, q, scale, minimum)


def read_blocks(path: Path) -> list[Blocks]:
    """Every Q8_0 and Q4_1 tensor of a GGUF file (other formats are left to the fp32 weights)."""
    from gguf import GGUFReader

    out = []
    for tensor in GGUFReader(str(path)).tensors:
        fmt = tensor.tensor_type.name
        if fmt not in FORMATS:
            continue
        cols, rows = (int(n) for n in tensor.shape[:2])  # GGUF lists the fastest dimension first
        out.append(_unpack(tensor.name, fmt, np.asarray(tensor.data), rows, cols))
    return out


def _row_keys(matrix: np.ndarray) -> list[bytes]:
    matrix = np.ascontiguousarray(matrix, dtype=np.float32)
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in matrix]


class BlockIndex:
    """Finds the GGUF blocks behind an fp32 weight matrix whose rows are GGUF rows, in any order."""

    def __init__(self, tensors: list[Blocks]):
        self.tensors = tensors
        self.where: dict[bytes, tuple[int, int]] = {}
        for t, blocks in enumerate(tensors):
            for r, key in enumerate(_row_keys(blocks.dequantized())):
                self.where.setdefault(key, (t, r))

    def match(self, rows: np.ndarray) -> Blocks | None:
        """The blocks whose dequantized rows equal `rows` [N, K] exactly, or None."""
        found: list = [self.where.get(key) for key in _row_keys(rows)]  # (tensor, row) or None each
        if not found or any(f is None for f in found) or len({t for t, _ in found}) != 1:
            return None
        blocks = self.tensors[found[0][0]]
        if blocks.q.shape[1] != rows.shape[1]:
            return None
        return blocks.rows(np.array([r for _, r in found]))
