"""The model kind: what a checkpoint is (models.family decides it from config.json) and what an engine
directory says it serves (the manifest's `model.kind`). Here, in the shared engine directory package, so that
building, serving, eval and deploy compare kinds with the same members. A StrEnum: each member equals, formats
and serializes as its string, so manifests on disk read and write the same text."""

from __future__ import annotations

from enum import StrEnum


class ModelKind(StrEnum):
    DECODER = "decoder"  # a causal LM with a KV cache: served by generation
    ENCODER = "encoder"  # hidden states out: served as embeddings (pooled)
    SCORER = "scorer"  # a cross-encoder: an encoder with a sequence-classification head, a pair in, logits out
    PARALLEL_TRACK = "parallel_track"  # a parallel-track decoder (models/parallel_track.py), built as shards
