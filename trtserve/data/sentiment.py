"""Downstream accuracy: a sentiment head (logistic regression, numpy) trained on torch fp32 MiniLM
embeddings of real labelled movie-review sentences (Pang & Lee, the source SST was built from,
shipped in gensim), then evaluated on held-out sentences with the embeddings of each backend and
precision. The head is saved as a small checkpoint in the cache, keyed by the encoder's weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from trtserve.errors import TrtServeError

POLARITY_FILE = "pang_lee_polarity.cor"
TEST_SHARE = 0.3


def polarity() -> tuple[list[str], np.ndarray]:
    """200 sentences with labels 1 (positive) and 0 (negative)."""
    from trtserve.data.corpus import wiki_path

    path = wiki_path().parent / POLARITY_FILE  # the same gensim test-data folder
    if not path.is_file():
        raise TrtServeError(f"{path} is missing: pip install gensim==4.4.0")
    texts, labels = [], []
    for line in path.read_text(encoding="cp1252").splitlines():  # the corpus is Windows-1252, not UTF-8
        label, _, text = line.partition(" ")
        texts.append(text.strip())
        labels.append(1 if label == "__label__pos" else 0)
    return texts, np.array(labels)


def split(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    cut = int(round(n * (1 - TEST_SHARE)))
    return np.sort(order[:cut]), np.sort(order[cut:])


def train_head(x: np.ndarray, y: np.ndarray, l2: float = 1e-2, steps: int = 2000, lr: float = 2.0) -> dict:
    """Logistic regression by full-batch gradient descent (deterministic)."""
    w, b = np.zeros(x.shape[1]), 0.0
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(x @ w + b)))
        w -= lr * (x.T @ (p - y) / len(y) + l2 * w)
        b -= lr * float(np.mean(p - y))
    return {"weight": w, "bias": b}


def predict(head: dict, x: np.ndarray) -> np.ndarray:
    return (x @ head["weight"] + head["bias"] > 0).astype(int)


def embed_all(text_engine, texts: list[str], chunk: int) -> np.ndarray:
    return np.concatenate([text_engine.embed(texts[i:i + chunk]) for i in range(0, len(texts), chunk)])


def head_for(engine, reference_embeddings: np.ndarray, labels: np.ndarray) -> dict:
    """The head trained on torch fp32 embeddings of the training split; cached by the engine's source."""
    from trtserve.fileio import cache_root

    path = cache_root() / "heads" / f"sentiment-{engine.manifest.model.source_sha256[:16]}.npz"
    if path.is_file():
        data = np.load(path)
        return {"weight": data["weight"], "bias": float(data["bias"])}
    train, _ = split(len(labels))
    head = train_head(reference_embeddings[train], labels[train])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, weight=head["weight"], bias=head["bias"])
    return head


def downstream(backends: dict[str, Any], reference_key: str, out: Path) -> dict:
    """Accuracy on the held-out split for each named backend (a TextEngine), and how many held-out
    predictions differ from the torch fp32 reference's."""
    texts, labels = polarity()
    chunk = min(b.backend.engine.manifest.shapes.batch.max for b in backends.values())
    embeddings = {name: embed_all(engine, texts, chunk) for name, engine in backends.items()}
    reference = backends[reference_key]
    head = head_for(reference.backend.engine, embeddings[reference_key], labels)
    train, test = split(len(labels))
    base = predict(head, embeddings[reference_key][test])
    result: dict[str, Any] = {
        "data": f"Pang & Lee polarity sentences (gensim), {len(train)} train / {len(test)} held out",
        "head": "logistic regression on torch fp32 embeddings", "accuracy": {}, "flips_vs_fp32": {}}
    for name, x in embeddings.items():
        guess = predict(head, x[test])
        result["accuracy"][name] = float(np.mean(guess == labels[test]))
        result["flips_vs_fp32"][name] = int(np.sum(guess != base))
    result["train_accuracy_fp32"] = float(np.mean(predict(head, embeddings[reference_key][train]) == labels[train]))
    (out / "downstream.json").write_text(json.dumps(result, indent=1))
    return result
