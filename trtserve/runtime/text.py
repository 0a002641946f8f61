"""Text in, text or vectors out, over any Backend, with the `tokenizers` library only (no torch)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trtserve.errors import InputError
from trtserve.runtime import generate
from trtserve.runtime.base import Backend
from trtserve.runtime.events import FinishReason
from trtserve.runtime.sampling import SamplingParams, finish_reason


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


@dataclass(frozen=True)
class SpecialTokens:
    """An engine's special tokens, read one way for the batcher, the track server and chat templates:
    the ids that end a sequence (`eos_token_id` of config.json or generation_config.json, an id or a
    list, and the id of tokenizer_config.json's `eos_token`), the padding id, and the bos/eos strings
    that chat templates are given."""

    eos_ids: frozenset[int]
    pad_id: int
    bos_token: str
    eos_token: str

    @classmethod
    def of(cls, engine_path: Path, tokenizer) -> SpecialTokens:
        path = Path(engine_path)
        config = _json(path / "config.json") | _json(path / "generation_config.json")
        names = _json(path / "tokenizer_config.json")
        bos, eos = (_content(names.get(key)) for key in ("bos_token", "eos_token"))
        ids = config.get("eos_token_id")
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if eos and tokenizer.token_to_id(eos) is not None:
            ids.add(tokenizer.token_to_id(eos))
        return cls(frozenset(int(i) for i in ids), int(config.get("pad_token_id") or 0), bos, eos)


def _content(value) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content", "") if isinstance(value, dict) else value if isinstance(value, str) else ""


def load_tokenizer(engine_path: Path):
    """The engine's tokenizer, with padding and truncation off: we pad, and never truncate silently."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(engine_path) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def token_ids(tokenizer, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    return [enc.ids for enc in tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]


def truncated_ids(tokenizer, texts: list[str], limit: int, direction: str) -> list[list[int]]:
    """Token ids with the special tokens, at most `limit` of them: the text's tokens are cut (from the end,
    direction "right", or the start, "left") and the special tokens put around what is left."""
    room = limit - tokenizer.num_special_tokens_to_add(False)
    if room < 1:
        raise ValueError(f"{limit} tokens leave no room for text beside the special tokens")
    rows = []
    for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
        enc.truncate(room, direction=direction)
        rows.append(tokenizer.post_process(enc, None, True).ids)
    return rows


class Pair(list):
    """A cross-encoder's row: the token ids of (query, document) joined by the tokenizer, and their token types."""

    def __init__(self, ids, types):
        super().__init__(ids)
        self.types = list(types)


class WithHidden(list):
    """A token-id row whose caller wants its last hidden state as well as its embedding (raw tensors
    over KServe v2); rows of both kinds share a batch."""


class TextEngine:
    """Tokenizer + backend for one engine dir."""

    def __init__(self, backend: Backend):
        self.backend = backend
        path = backend.engine.path
        self.tokenizer = load_tokenizer(path)
        self.special = SpecialTokens.of(path, self.tokenizer)
        self.eos_ids, self.pad_id = set(self.special.eos_ids), self.special.pad_id
        manifest = backend.engine.manifest
        self.max_seq = manifest.shapes.sequence.max if manifest.shapes else manifest.model.architecture.max_positions
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
        """Sentence embeddings (B, D), pooled as the checkpoint says (the manifest's pooling)."""
        self._batch(texts)  # length check with a clear message
        return self.embed_ids(self.tokenize(texts))

    def embed_ids(self, rows: list[list[int]]) -> np.ndarray:
        """Embeddings of token-id rows, right-padded to the longest row."""
        return self._encode(rows)[0]

    def encode_ids(self, rows: list[list[int]]):
        """What each row's caller asked for: the (B, H) embeddings when no row is a WithHidden; else one
        item per row, its embedding or, for a WithHidden row, (embedding, its last hidden state (len, H))."""
        hidden = any(isinstance(row, WithHidden) for row in rows)
        embeddings, states = self._encode(rows, hidden)
        if not hidden:
            return embeddings
        return [(e, states[i, : len(row)]) if isinstance(row, WithHidden) else e
                for i, (e, row) in enumerate(zip(embeddings, rows))]

    def _encode(self, rows: list[list[int]], hidden: bool = False):
        longest = max(map(len, rows))
        ids = np.full((len(rows), longest), self.pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, row in enumerate(rows):  # right padding for encoders
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self.input_names:
            feeds["token_type_ids"] = np.zeros_like(ids)
            for i, row in enumerate(rows):
                if isinstance(row, Pair):
                    feeds["token_type_ids"][i, : len(row)] = row.types
        outputs = self.backend.infer(feeds)
        if "sentence_embedding" not in outputs:  # a cross-encoder: its head's logits (B, labels)
            return outputs["logits"], None
        pooled = outputs["sentence_embedding"]
        if self.backend.engine.manifest.pooling is None:  # built before pooling was in the graph: mean, normalized here
            pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        return pooled, outputs["last_hidden_state"] if hidden else None

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
        out: list[int]
        params, out = SamplingParams(max_tokens=max_new_tokens, temperature=0), []
        for token in tokens[0].tolist():
            finish = finish_reason(token, params, self.eos_ids, len(out) + 1, longest + len(out) + 1, self.max_seq)
            if finish is FinishReason.STOP:
                break
            out.append(token)
            if finish:
                break
        return self.tokenizer.decode(out)
