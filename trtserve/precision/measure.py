"""Measure an engine against HF's own torch fp32 model on real text, at several lengths.

The reference is the checkpoint loaded by transformers with its stock eager attention, its own
mask code and its own KV cache, so the measurement covers the export wrapper too. The same
harness gives fp32 parity (strict thresholds) and mixed-precision fidelity (the target).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.precision.fidelity import Tally, compare, next_token_nll, top1_agreement
from trtserve.runtime import generate
from trtserve.runtime.base import Backend

DECODE_STEPS = 32
DECODE_PROMPT = 64
RANDOM_TOKEN_COSINE = 0.99
FP16_TOP1 = 0.99
WIDE_BATCH = 8  # the shapes beyond the real-text cases: batch 8 at lengths up to WIDE_TOKENS / 8, batch 1 at all
WIDE_TOKENS = 1024
WIDE_REAL_LENGTH = 128


TARGET_KEYS = {"cosine": "min_cosine", "token_cosine": "min_token_cosine", "top1": "min_top1",
               "ppl_delta": "max_ppl_delta", "max_abs": "max_abs_error", "mean_cosine": "min_mean_cosine",
               "neighbours": "min_neighbours", "flips": "max_flips", "random_token_cosine": "min_random_token_cosine"}


@dataclass(frozen=True)
class Target:
    """What a build must reach. fp32 builds use `parity()`; mixed ones the fidelity default."""

    min_cosine: float = 0.9998
    min_token_cosine: float = 0.999
    min_top1: float = 0.995
    max_ppl_delta: float = 0.005
    max_abs_error: float | None = None  # encoder outputs, fp32 parity only
    max_nonfinite: int = 0
    # encoders, on the labelled real sentences (`sentences` in the report); None: not checked
    min_mean_cosine: float | None = None  # mean sentence-embedding cosine
    min_neighbours: float | None = None  # top-10 nearest-neighbour agreement
    max_flips: int | None = None  # held-out predictions of the sentiment head that change
    # random token ids (out of distribution: flat next-token distributions, activations real text never
    # reaches): a robustness check, judged by cosines (overall and worst token at this bound, or min_cosine
    # if lower) and NaN/Inf, not top-1 or perplexity; None: min(min_token_cosine, 0.99)
    min_random_token_cosine: float | None = None

    @property
    def random_token_cosine(self) -> float:
        bound = self.min_random_token_cosine
        return min(self.min_token_cosine, RANDOM_TOKEN_COSINE) if bound is None else bound

    @classmethod
    def parity(cls) -> Target:
        return cls(min_cosine=0.99999, min_token_cosine=0.9999, min_top1=1.0, max_ppl_delta=1e-3, max_abs_error=1e-4,
                   min_random_token_cosine=0.9999)

    @classmethod
    def for_weights(cls, weights: str, kind: ModelKind) -> Target:
        """The default target of a policy by its weight format: decoders are judged by top-1 agreement and
        perplexity (logit cosines only guard against garbage), encoders by their embeddings' cosines."""
        if weights == "int8":
            return cls(min_cosine=0.9995, min_token_cosine=0.999, min_mean_cosine=0.9995, min_neighbours=0.95,
                       max_flips=1) if kind != ModelKind.DECODER else \
                cls(min_cosine=0.995, min_token_cosine=0.95, min_top1=0.99, max_ppl_delta=0.01)
        if weights == "int4":
            return cls(min_cosine=0.999, min_token_cosine=0.995) if kind != ModelKind.DECODER else \
                cls(min_cosine=0.98, min_token_cosine=0.8, min_top1=0.97, max_ppl_delta=0.03)
        # fp16 weights: decoders' top-1 as int8's (hybrid flips 0.6% of near-ties at batch 8 x 128 under
        # fp16 emulation), perplexity and cosines stricter
        return cls(min_top1=FP16_TOP1) if weights == "float" and kind == ModelKind.DECODER else cls()

    @classmethod
    def parse(cls, text: str) -> Target:
        """'cosine=0.9998,token_cosine=0.999,top1=0.995,ppl_delta=0.005' (any subset)."""
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, _, value = item.partition("=")
            if key not in TARGET_KEYS:
                raise ValueError(f"unknown fidelity key {key!r}; use {', '.join(TARGET_KEYS)}")
            values[TARGET_KEYS[key]] = int(float(value)) if key == "flips" else float(value)
        return cls(**values)

    def text(self) -> str:
        """What `parse` reads back as this target (the fields it sets; the others keep their defaults)."""
        return ",".join(f"{key}={getattr(self, field)!r}" for key, field in TARGET_KEYS.items()
                        if getattr(self, field) is not None)


class Corpus:
    """Real text to measure on: the bundled Wikipedia sample, or a user's file."""

    def __init__(self, paragraphs: list[str], name: str):
        self.paragraphs, self.name = paragraphs, name

    @classmethod
    def wikipedia(cls) -> Corpus:
        from trtserve.data.corpus import wiki_paragraphs

        return cls(list(wiki_paragraphs()), "Wikipedia (gensim enwiki sample)")

    @classmethod
    def from_file(cls, path) -> Corpus:
        text = open(path, encoding="utf-8", errors="replace").read()
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()] or [text]
        return cls(paragraphs, f"file {path}")

    def rows(self, tokenizer, count: int, length: int, special: bool = True) -> list[list[int]]:
        """`count` token rows of exactly `length` tokens from consecutive text, different starts."""
        step = max(1, len(self.paragraphs) // (count + 1))
        rows = []
        for r in range(count):
            ids: list[int]
            ids, i = [], r * step
            while len(ids) < length and i < r * step + len(self.paragraphs):
                chunk = self.paragraphs[i % len(self.paragraphs)]
                ids += tokenizer(chunk, add_special_tokens=False)["input_ids"]
                i += 1
            rows.append(ids[:length])
        if min(map(len, rows)) < length:
            raise ValueError(f"the calibration text has fewer than {length} tokens")
        if special and tokenizer.cls_token_id is not None and tokenizer.sep_token_id is not None:
            rows = [[tokenizer.cls_token_id] + row[: length - 2] + [tokenizer.sep_token_id] for row in rows]
        return rows


def random_ids(vocab: int, rng, shape) -> np.ndarray:
    """Random token ids as the evaluation draws them: above the first 1,000 ids (special and byte
    tokens in most vocabularies) when the vocabulary is large enough."""
    return rng.integers(1000 if vocab > 2000 else 0, vocab, size=shape).astype(np.int64)


def wide_shapes(lengths, max_batch: int) -> list[tuple[str, int, int]]:
    """(input, batch, length) measured beyond the real-text cases: random ids at batch 1 on every length
    and at batch 8 (half the rows padded, by different amounts) up to WIDE_TOKENS tokens, and real text
    at batch 8."""
    batch = min(WIDE_BATCH, max_batch)
    shapes = [("random", 1, n) for n in lengths]
    if batch > 1:
        shapes += [("random", batch, n) for n in lengths if batch * n <= WIDE_TOKENS]
        shapes.append(("real", batch, WIDE_REAL_LENGTH if WIDE_REAL_LENGTH in lengths else min(lengths)))
    return shapes


def _wide_rows(engine, tokenizer, corpus: Corpus, kind: str, batch: int, length: int, left: bool):
    """Token ids and mask of one wide shape: rows past the first half padded by 1/8, 1/4, 1/2, 3/4."""
    if kind == "random":
        vocab = engine.manifest.model.architecture.vocab_size
        rng = np.random.default_rng([batch, length])
        ids = random_ids(vocab, rng, (batch, length))
    else:
        ids = np.array(corpus.rows(tokenizer, batch, length, special=not left))
    ids, mask = ids.astype(np.int64), np.ones((batch, length), np.int64)
    fractions = (1 / 8, 1 / 4, 1 / 2, 3 / 4)
    for row in range(batch // 2, batch):
        pad = min(length - 1, max(1, int(length * fractions[(row - batch // 2) % 4])))
        span = slice(0, pad) if left else slice(length - pad, length)
        ids[row, span], mask[row, span] = tokenizer.pad_token_id or 0, 0
    return ids, mask


def _label(kind: str, batch: int, length: int) -> str:
    return f"{kind} b{batch} seq{length}"


def grid_shapes(name: str, shapes, seed: int, model_id: str, max_batch: int, max_seq: int) -> list[tuple]:
    """(grid name, input, batch, length, seed) of an evaluation grid's (model, input, batch, length) shapes
    that are `model_id`'s and within the engine's shape range."""
    from trtserve.errors import TrtServeError

    kept = sorted({(kind, batch, length) for model, kind, batch, length in shapes
                   if model == model_id and batch <= max_batch and length <= max_seq})
    if not kept:
        models = ", ".join(sorted({shape[0] for shape in shapes}))
        raise TrtServeError(f"--confirm-grid {name}: the grid has no shape for {model_id} within batch {max_batch} "
                            f"x sequence {max_seq}; its models are {models}")
    from pathlib import Path

    label = Path(name).stem  # a preset's name, or a grid file's
    return [(label, kind, batch, length, seed) for kind, batch, length in kept]


def grid_ids(engine, kind: str, batch: int, length: int, seed: int) -> np.ndarray:
    """The token ids `trtserve eval` feeds for one shape: random ids from a generator seeded by (seed, batch,
    length), or rows of consecutive Wikipedia text, a different passage per row."""
    if kind == "random":
        vocab = engine.manifest.model.architecture.vocab_size
        rng = np.random.default_rng([seed, batch, length])
        return random_ids(vocab, rng, (batch, length))
    from trtserve.data.corpus import wiki_text
    from trtserve.runtime.text import load_tokenizer

    tokenizer = load_tokenizer(engine.path)
    rows = [tokenizer.encode(wiki_text(2 * length, 10 * i), add_special_tokens=False).ids[:length]
            for i in range(batch)]
    return np.array(rows, dtype=np.int64)


def _grid_rows(engine, kind: str, batch: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    ids = grid_ids(engine, kind, batch, length, seed)
    return ids, np.ones_like(ids)


def encoder_report(backend: Backend, ref_model, tokenizer, lengths, corpus: Corpus, wide: bool = True,
                   grid=()) -> dict:
    """Encoders: token states and the pooled vector; scorers (cross-encoders): the head's logits, and the
    ranking of real sentences against queries."""
    scorer = backend.engine.manifest.model.kind == ModelKind.SCORER
    case = _scorer_case if scorer else _vector_case
    cases = {}
    for length in lengths:
        batch = 4 if length <= 128 else 2
        ids = np.array(corpus.rows(tokenizer, batch, length), dtype=np.int64)
        mask = np.ones_like(ids)
        mask[1, length - length // 4:] = 0  # row 1 right-padded: covers padding masks
        ids[1, length - length // 4:] = tokenizer.pad_token_id or 0
        cases[f"seq{length}"] = case(backend, ref_model, ids, mask)
    assert backend.engine.manifest.shapes is not None  # every engine's (its backend checks feeds against them)
    for kind, batch, length in wide_shapes(lengths, backend.engine.manifest.shapes.batch.max) if wide else ():
        ids, mask = _wide_rows(backend.engine, tokenizer, corpus, kind, batch, length, left=False)
        cases[_label(kind, batch, length)] = {"input": kind, **case(backend, ref_model, ids, mask)}
    for name, kind, batch, length, seed in grid:
        ids, mask = _grid_rows(backend.engine, kind, batch, length, seed)
        cases[f"{name} {_label(kind, batch, length)}"] = {"input": kind,
                                                          **case(backend, ref_model, ids, mask)}
    if scorer:
        return {"text": corpus.name, "cases": cases, "ranking": ranking_report(backend, ref_model, tokenizer)}
    return {"text": corpus.name, "cases": cases, "sentences": sentences_report(backend, ref_model, tokenizer)}


def pooled_reference(engine, hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """What the engine's graph should output as sentence_embedding, computed in numpy from the reference's
    token states (models.pooling.pool); an engine built before pooling was in the graph: the plain mean."""
    from trtserve.models.pooling import Pooling, from_manifest, pool

    if engine.manifest.pooling is None:
        return pool(Pooling(("mean",), False), hidden, mask)
    pooling = from_manifest(engine.manifest.pooling)
    return pool(pooling, hidden, mask, _dense_weights(engine.manifest.model.source_path, pooling.dense))


@lru_cache(maxsize=4)
def _dense_weights(source_path: str, dense: tuple) -> list:
    """A checkpoint's Dense modules' weights, read once for all the cases of its fidelity runs."""
    from pathlib import Path

    from trtserve.models.pooling import Pooling, load_dense

    return load_dense(Path(source_path), Pooling(("mean",), False, dense))


def _scorer_case(backend: Backend, ref_model, ids: np.ndarray, mask: np.ndarray) -> dict:
    import torch

    feeds = _encoder_feeds(backend, ids, mask)
    out = backend.infer(feeds)["logits"]
    with torch.inference_mode():
        ref = ref_model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()
    # one row per label holding the batch's scores: a row of one logit would only compare signs
    return {"batch": int(ids.shape[0]), "tokens": int(mask.sum()), "scores": compare(ref.T, out.T)}


def _encoder_feeds(backend: Backend, ids: np.ndarray, mask: np.ndarray) -> dict:
    names = {spec.name for spec in backend.inputs}
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    return {k: v for k, v in feeds.items() if k in names}


def _tokenized_chunks(backend: Backend, tokenizer, *columns: list[str]):
    """Feeds of the texts (two columns: pairs), up to 32 rows at a time, each chunk padded to its longest row
    and cut to the engine's limit."""
    names = {spec.name for spec in backend.inputs}
    assert backend.engine.manifest.shapes is not None
    chunk = min(32, backend.engine.manifest.shapes.batch.max)
    max_seq = backend.engine.manifest.shapes.sequence.max
    for i in range(0, len(columns[0]), chunk):
        enc = tokenizer(*(column[i:i + chunk] for column in columns), padding=True, truncation=True,
                        max_length=max_seq, return_tensors="np")
        yield {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids") if k in names}


QUERIES = ("a warm and funny film worth seeing", "a dull, badly acted film")
TOP = 10


def ranking_report(backend: Backend, ref_model, tokenizer) -> dict:
    """The labelled polarity sentences scored against two queries as pairs (query, sentence), batched and
    padded: the largest score error, and how many of each query's top-10 sentences the engine keeps."""
    import torch

    from trtserve.data.sentiment import POLARITY_FILE, polarity

    texts, _ = polarity()
    worst_error, overlaps = 0.0, []
    ours: list | np.ndarray
    ref: list | np.ndarray
    for query in QUERIES:
        ours, ref = [], []
        for feeds in _tokenized_chunks(backend, tokenizer, [query] * len(texts), texts):
            ours.append(backend.infer(feeds)["logits"][:, 0])
            with torch.inference_mode():
                ref.append(ref_model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).logits.numpy()[:, 0])
        ours, ref = np.concatenate(ours).astype(np.float64), np.concatenate(ref).astype(np.float64)
        worst_error = max(worst_error, float(np.abs(ours - ref).max()) if np.isfinite(ours).all() else float("inf"))
        overlaps.append(len(set(np.argsort(-ours)[:TOP]) & set(np.argsort(-ref)[:TOP])) / TOP)
    return {"data": f"{len(texts)} Pang & Lee polarity sentences ({POLARITY_FILE}, gensim) against {len(QUERIES)} "
                    "queries", "max_score_error": worst_error, "top10_agreement": min(overlaps)}


def _vector_case(backend: Backend, ref_model, ids: np.ndarray, mask: np.ndarray) -> dict:
    import torch

    feeds = _encoder_feeds(backend, ids, mask)
    out = backend.infer(feeds)
    with torch.inference_mode():
        ref = ref_model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
    keep = mask.astype(bool)
    ref_pooled = pooled_reference(backend.engine, ref, mask)
    return {
        "batch": int(ids.shape[0]),
        "tokens": int(keep.sum()),
        "hidden": compare(ref[keep], out["last_hidden_state"][keep]),
        "embedding": compare(ref_pooled, out["sentence_embedding"]),
    }


NEIGHBOURS = 10


def sentences_report(backend: Backend, ref_model, tokenizer) -> dict:
    """Sentence embeddings of the labelled real sentences (each batch padded to its longest): mean and
    worst cosine, top-10 nearest-neighbour agreement, and how many held-out predictions of a sentiment
    head trained on the reference's embeddings change."""
    import torch

    from trtserve.data.sentiment import POLARITY_FILE, polarity, predict, split, train_head

    texts, labels = polarity()
    ours: list | np.ndarray
    ref: list | np.ndarray
    ours, ref = [], []
    for feeds in _tokenized_chunks(backend, tokenizer, texts):
        ours.append(backend.infer(feeds)["sentence_embedding"])
        with torch.inference_mode():
            hidden = ref_model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).last_hidden_state.numpy()
        ref.append(pooled_reference(backend.engine, hidden, feeds["attention_mask"]))
    ours, ref = np.concatenate(ours).astype(np.float64), np.concatenate(ref)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    cos = (unit(ours) * unit(ref)).sum(1)
    train, test = split(len(labels))
    head = train_head(ref[train], labels[train])
    return {"data": f"{len(texts)} Pang & Lee polarity sentences ({POLARITY_FILE}, gensim)",
            "mean_cosine": float(cos.mean()),
            "worst_cosine": float(cos.min()) if np.isfinite(ours).all() else float("nan"),
            "neighbours": neighbour_agreement(unit(ref), unit(ours)),
            "sentiment_flips": int(np.sum(predict(head, ref[test]) != predict(head, ours[test]))),
            "sentiment_held_out": int(len(test))}


def neighbour_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Mean share of each sentence's top-10 neighbours (by cosine, itself excluded) that both agree on."""
    k = min(NEIGHBOURS, len(a) - 1)
    tops = []
    for x in (a, b):
        sim = x @ x.T
        np.fill_diagonal(sim, -np.inf)
        tops.append(np.argsort(-sim, axis=1)[:, :k])
    return float(np.mean([len(set(p) & set(q)) / k for p, q in zip(*tops)])) if k > 0 else 1.0


@dataclass(frozen=True)
class DecoderInput:
    """One case of a decoder's report: its label, (B, S) ids and mask, and the report's `input` entry ("random" or
    "real"; None for the real-text lengths)."""

    label: str
    ids: np.ndarray
    mask: np.ndarray
    kind: str | None = None

    @property
    def real(self) -> bool:
        """Real text: judged by top-1 and perplexity too."""
        return self.kind != "random"


def decoder_inputs(engine, tokenizer, lengths, corpus: Corpus, wide: bool = True, grid=()) -> list[DecoderInput]:
    """The cases a decoder's report measures: real text at each length, then the wide shapes and the grid's."""
    out = [DecoderInput(f"seq{n}", *_prefill_rows(tokenizer, n, corpus)) for n in lengths]
    for kind, batch, length in wide_shapes(lengths, engine.manifest.shapes.batch.max) if wide else ():
        ids, mask = _wide_rows(engine, tokenizer, corpus, kind, batch, length, left=True)
        out.append(DecoderInput(_label(kind, batch, length), ids, mask, kind))
    for name, kind, batch, length, seed in grid:
        ids, mask = _grid_rows(engine, kind, batch, length, seed)
        out.append(DecoderInput(f"{name} {_label(kind, batch, length)}", ids, mask, kind))
    return out


def decode_prompt(engine, tokenizer, corpus: Corpus) -> np.ndarray:
    """The decode case's two prompts of real text, DECODE_STEPS short of the engine's context at most."""
    prompt = min(DECODE_PROMPT, engine.manifest.shapes.total_sequence.max - DECODE_STEPS)
    return np.array(corpus.rows(tokenizer, 2, prompt, special=False), dtype=np.int64)


def decoder_report(backend: Backend, reference, inputs: list[DecoderInput], prompt: np.ndarray | None,
                   text: str) -> dict:
    """Each input through the engine against `reference` (precision.reference.Reference, prepared on the same
    inputs), and the decode case where a prompt is given."""
    cases = {}
    for case in inputs:
        measured = _decoder_case(backend, reference, case.ids, case.mask, case.real)
        cases[case.label] = measured if case.kind is None else {"input": case.kind, **measured}
    if prompt is None:
        return {"text": text, "cases": cases}
    return {"text": text, "cases": cases, "decode": _decoder_decode(backend, reference, prompt)}


def _prefill_rows(tokenizer, length: int, corpus: Corpus) -> tuple[np.ndarray, np.ndarray]:
    batch = 2 if length <= 512 else 1
    ids = np.array(corpus.rows(tokenizer, batch, length, special=False), dtype=np.int64)
    mask = np.ones_like(ids)
    if batch > 1:  # row 1 left-padded: covers padding masks and per-row positions
        ids[1, : length // 4] = tokenizer.pad_token_id or 0
        mask[1, : length // 4] = 0
    return ids, mask


LOGIT_BYTES = 1 << 27  # fp32 logits held per side at a time (128 MiB): positions are compared in chunks of that


def position_chunk(batch: int, vocab: int) -> int:
    """How many positions of (batch, vocab) logits one chunk of the comparison takes (at least 16)."""
    return max(16, LOGIT_BYTES // (4 * batch * vocab))


def _decoder_case(backend, reference, ids: np.ndarray, mask: np.ndarray, real: bool) -> dict:
    """Logits of every kept position against the reference, a chunk of positions at a time: the engine prefills
    the chunk over the cache of those before it (as the server's chunked prefill does), the reference's LM head
    reads the chunk's rows of its hidden states. Top-1 and perplexity on real text only (random ids have flat
    next-token distributions whose near-ties make both meaningless)."""
    case = LogitsCase(ids, mask, real)
    state = generate.start(backend, ids.shape[0])
    chunk = position_chunk(ids.shape[0], backend.engine.manifest.model.architecture.vocab_size)
    for start in range(0, ids.shape[1], chunk):
        end = min(start + chunk, ids.shape[1])
        out = generate.step(backend, state, ids[:, start:end], mask[:, start:end])
        case.add(start, reference.logits(ids, mask, start, end), out)
    return case.result()


class LogitsCase:
    """A decoder case accumulated from chunks of positions: (B, c, V) logits of the reference and the engine at
    positions start..start+c of the same (B, S) ids."""

    def __init__(self, ids: np.ndarray, mask: np.ndarray, real: bool):
        self.ids, self.keep, self.real = ids, mask.astype(bool), real
        self.tally, self.agree, self.count = Tally(), 0, 0
        self.nll: dict[str, list[np.ndarray]] = {"ref": [], "out": []}

    def add(self, start: int, ref: np.ndarray, out: np.ndarray) -> None:
        end = start + ref.shape[1]
        keep = self.keep[:, start:end]
        ref_rows, out_rows = ref[keep], out[keep]
        self.tally.add(ref_rows, out_rows)
        if not self.real:
            return
        self.agree += int(np.sum(ref_rows.argmax(-1) == out_rows.argmax(-1)))
        self.count += len(ref_rows)
        stop = min(end, self.ids.shape[1] - 1)  # the last position has no next token
        scored = self.keep[:, start:stop] & self.keep[:, start + 1:stop + 1]
        targets = self.ids[:, start + 1:stop + 1][scored]
        for name, logits in (("ref", ref), ("out", out)):
            self.nll[name].append(next_token_nll(logits[:, :stop - start][scored], targets))

    def result(self) -> dict:
        case = {"batch": int(self.ids.shape[0]), "tokens": int(self.keep.sum()), "logits": self.tally.result()}
        if self.real:
            ppl_ref, ppl_out = (float(np.exp(np.concatenate(self.nll[k]).mean())) for k in ("ref", "out"))
            case.update({
                "top1_agreement": self.agree / self.count if self.count else 1.0,
                "perplexity_torch": ppl_ref,
                "perplexity_engine": ppl_out,
                "perplexity_rel_delta": abs(ppl_out - ppl_ref) / ppl_ref if np.isfinite(ppl_out) else float("inf"),
            })
        return case


def logits_case(ref: np.ndarray, logits: np.ndarray, ids: np.ndarray, mask: np.ndarray, real: bool) -> dict:
    """A decoder case from whole [B, S, V] logits and the reference's on the same ids."""
    case = LogitsCase(ids, mask, real)
    case.add(0, ref, logits)
    return case.result()


def _decoder_decode(backend, reference, ids: np.ndarray) -> dict:
    """HF `generate` (greedy, its own KV cache) vs the engine fed the same tokens step by step."""
    ref_tokens, ref_logits = reference.decoded(ids)
    mask = np.ones_like(ids)
    _, logits = generate.greedy(backend, ids, mask, DECODE_STEPS, forced=ref_tokens)
    free_tokens, _ = generate.greedy(backend, ids, mask, DECODE_STEPS)
    return {
        "batch": int(ids.shape[0]),
        "prompt": int(ids.shape[1]),
        "steps": DECODE_STEPS,
        "logits": compare(ref_logits, logits),
        "top1_agreement": top1_agreement(ref_logits, logits),
        "greedy_tokens_identical": bool(np.array_equal(free_tokens, ref_tokens)),
    }


def failures(report: dict, target: Target) -> list[str]:
    """Every way `report` misses `target`, as readable strings (empty: it passes)."""
    out = []
    for label, case in list(report["cases"].items()) + ([("decode", report["decode"])] if "decode" in report else []):
        tensors = {k: v for k, v in case.items() if isinstance(v, dict) and "cosine" in v}
        random = case.get("input") == "random"  # a robustness check: no broken token, not the quality target
        token_bound = target.random_token_cosine if random else target.min_token_cosine
        cosine_bound = min(target.min_cosine, token_bound) if random else target.min_cosine
        for name, m in tensors.items():
            where = f"{label} {name}"
            if m["nonfinite"] > target.max_nonfinite:
                out.append(f"{where}: {m['nonfinite']} NaN/Inf values")
            # written as not(x >= bound) so that NaN always counts as a miss
            if not m["cosine"] >= cosine_bound:
                out.append(f"{where}: cosine {m['cosine']:.6f} < {cosine_bound}")
            if not m["worst_row_cosine"] >= token_bound:
                out.append(f"{where}: worst-token cosine {m['worst_row_cosine']:.6f} < {token_bound}")
            encoder_tensor = name in ("hidden", "embedding", "scores")  # decoders are judged by top-1 and perplexity
            if encoder_tensor and target.max_abs_error is not None and not m["max_abs_error"] <= target.max_abs_error:
                out.append(f"{where}: max abs error {m['max_abs_error']:.2e} > {target.max_abs_error:.0e}")
        if "top1_agreement" in case and not case["top1_agreement"] >= target.min_top1:
            out.append(f"{label}: top-1 agreement {case['top1_agreement']:.4f} < {target.min_top1}")
        if "perplexity_rel_delta" in case and not case["perplexity_rel_delta"] <= target.max_ppl_delta:
            out.append(f"{label}: perplexity delta {case['perplexity_rel_delta']:.2e} > {target.max_ppl_delta}")
    ranking = report.get("ranking")
    if ranking:
        if target.max_abs_error is not None and not ranking["max_score_error"] <= max(target.max_abs_error, 1e-4):
            out.append(f"ranking: score error {ranking['max_score_error']:.2e} > {max(target.max_abs_error, 1e-4):.0e}")
        bound: float | None = target.min_neighbours if target.min_neighbours is not None else 0.9
        if not ranking["top10_agreement"] >= bound:
            out.append(f"ranking: top-10 agreement {ranking['top10_agreement']:.2f} < {bound}")
    sentences = report.get("sentences")
    if sentences:
        checks = [("mean_cosine", target.min_mean_cosine, "mean sentence cosine", True),
                  ("neighbours", target.min_neighbours, "top-10 neighbour agreement", True),
                  ("sentiment_flips", target.max_flips, "sentiment predictions changed", False)]
        for key, bound, what, at_least in checks:
            value = sentences[key]
            if bound is not None and not (value >= bound if at_least else value <= bound):
                out.append(f"sentences: {what} {value:.6g} {'<' if at_least else '>'} {bound}")
    return out


def target_json(target: Target) -> dict:
    return asdict(target)
