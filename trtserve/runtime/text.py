"""Text in, text or vectors out, over any Backend, with the `tokenizers` library only (no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trtserve.errors import InputError
from trtserve.runtime import generate
from trtserve.runtime.base import Backend


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def load_tokenizer(engine_path: Path):
    """The engine's tokenizer, with padding and truncation off: we pad, and never truncate silently."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(engine_path) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def token_ids(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]


class TextEngine:
    """Tokenizer + backend for one engine dir."""

    def __init__(self, backend: Backend):
        self.backend = backend
        path = backend.engine.path
        self.tokenizer = load_tokenizer(path)
        config = _json(path / "config.json") | _json(path / "generation_config.json")
        eos = config.get("eos_token_id")
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.pad_id = int(config.get("pad_token_id") or 0)
        self.max_seq = backend.engine.manifest["shapes"]["sequence"]["max"]
        self.input_names = {spec.name for spec in backend.inputs}

    def _batch(self, texts: list[str], add_special_tokens: bool = True):
        rows = self.tokenize(texts, add_special_tokens)
        longest = max(map(len, rows))
        if longest > self.max_seq:
            raise InputError(f"a text has {longest} tokens, the engine's limit is {self.max_seq}")
        return rows, longest

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return token_ids(self.tokenizer, texts, add_special_tokens)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Mean-pooled, L2-normalised sentence embeddings (B, H)."""
        self._batch(texts)  # length check with a clear message
        return self.embed_ids(self.tokenize(texts))

    def embed_ids(self, rows: list[list[int]]) -> np.ndarray:
        """Embeddings of token-id rows, right-padded to the longest row."""
        longest = max(map(len, rows))
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, row in enumerate(rows):  # right padding for encoders
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
        pooled = self.backend.infer(feeds)["sentence_embedding"]
        return pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)

    def complete(self, prompt: str, max_new_tokens: int = 32) -> str:
        """Greedy continuation of one prompt, stopping at end-of-sequence."""
        rows, longest = self._batch([prompt], add_special_tokens=False)
        if longest + max_new_tokens > self.max_seq:
            raise InputError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the engine's "
                f"context of {self.max_seq}"
            )
        ids = np.array(rows, dtype=np.int64)
        tokens, _ = generate.greedy(self.backend, ids, np.ones_like(ids), max_new_tokens)
        out = []
        for token in tokens[0].tolist():
            if token in self.eos_ids:
                break
            out.append(token)
        return self.tokenizer.decode(out)
