"""Real text vs random token ids: how much random inputs underestimate fp16 risk.

For each input kind the probe records the activation ranges of the fp32 graph, the nodes the
policy would run in fp16 that leave the fp16 range, and what the fp16 emulation of the policy
does to the outputs: the rate of NaN/Inf values and the rate of tokens whose output diverges
from fp32 (cosine < 0.99).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.graph_files import graph_on_disk
from trtserve.precision.overflow import activation_ranges, flagged
from trtserve.precision.policy import Policy

DIVERGED_BELOW = 0.99


def probe_feeds(kind: ModelKind, ids: np.ndarray, input_names: list[str], past_shape=None) -> dict:
    mask = np.ones_like(ids)
    feeds = {"input_ids": ids, "attention_mask": mask}
    if "token_type_ids" in input_names:
        feeds["token_type_ids"] = np.zeros_like(ids)
    if kind == ModelKind.DECODER:
        feeds["position_ids"] = np.broadcast_to(np.arange(ids.shape[1]), ids.shape).astype(np.int64).copy()
        feeds["logit_positions"] = np.arange(ids.shape[1], dtype=np.int64)
        heads, dim = past_shape
        for name in input_names:
            if name.startswith("past_key_values."):
                feeds[name] = np.zeros((ids.shape[0], heads, 0, dim), np.float32)
    return feeds


def _token_rows(kind, source, tokenizer, corpus, count, length, rng):
    if kind == "real":
        return np.array(corpus.rows(tokenizer, count, length, special=source.info.kind != ModelKind.DECODER), np.int64)
    special = set(tokenizer.all_special_ids)
    vocab = np.array([i for i in range(source.info.vocab_size) if i not in special])
    return rng.choice(vocab, size=(count, length)).astype(np.int64)


def _output_name(source) -> str:
    return "last_hidden_state" if source.info.kind == ModelKind.ENCODER else "logits"


def real_vs_random(source, model, policy: Policy, tokenizer, corpus, length: int = 128, batches: int = 4,
                   seed: int = 0) -> dict:
    import onnxruntime as ort

    from trtserve.precision.passes import emulation_model, plan_policy

    rng = np.random.default_rng(seed)
    _, _, decisions, _, _ = plan_policy(model, policy)
    low = {name for name, is_low in decisions.items() if is_low}
    names = [v.name for v in model.graph.input]
    past = (source.info.num_kv_heads, source.info.head_dim)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    with graph_on_disk(model) as path:  # by path: a graph past 2 GB cannot be handed over as bytes
        reference = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    with graph_on_disk(emulation_model(model, policy)) as path:
        emulated = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    out_name = _output_name(source)
    report: dict[str, Any] = {}
    for kind in ("real", "random"):
        rows = _token_rows(kind, source, tokenizer, corpus, 2 * batches, length, rng)
        feeds_list = [probe_feeds(source.info.kind, rows[2 * b: 2 * b + 2], names, past) for b in range(batches)]
        ranges = activation_ranges(model, feeds_list)
        risky = flagged(ranges, model, policy)
        low_tensors = [t for t, node in ranges.producer.items() if node in low and t in ranges.total]
        over_values = sum(ranges.over[t] for t in low_tensors)
        all_values = sum(ranges.total[t] for t in low_tensors)
        values = tokens = nonfinite = diverged = 0
        for feeds in feeds_list:
            ref = reference.run([out_name], feeds)[0]
            out = emulated.run([out_name], feeds)[0]
            nonfinite += int(np.size(out) - np.count_nonzero(np.isfinite(out)))
            values += out.size
            a, b = ref.reshape(-1, ref.shape[-1]).astype(np.float64), out.reshape(-1, out.shape[-1]).astype(np.float64)
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
            diverged += int(np.sum(~(cos >= DIVERGED_BELOW)))
            tokens += a.shape[0]
        report[kind] = {
            "sequences": 2 * batches,
            "tokens": tokens,
            "max_activation": max(ranges.absmax.values()),  # mask sentinels excluded
            "fp16_overflow_nodes": len(risky),
            "overflow_value_rate": over_values / max(all_values, 1),
            "worst_nodes": risky[:10],
            "nonfinite_rate": nonfinite / values,
            "diverged_token_rate": diverged / tokens,
        }
    report["underestimation"] = {
        key: _ratio(report["real"][key], report["random"][key])
        for key in ("max_activation", "fp16_overflow_nodes", "overflow_value_rate", "nonfinite_rate",
                    "diverged_token_rate")
    }
    report.update(policy=policy.name, length=length, diverged_below=DIVERGED_BELOW)
    return report


def _ratio(real: float, random: float):
    if random == 0:
        return None if real == 0 else "inf"
    return real / random
