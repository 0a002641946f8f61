"""Train a parallel-track model and a dense model of the same size with one recipe, on real Wikipedia
text with SmolLM2's tokenizer, and report held-out perplexity; checkpoints are cached by recipe.

    trtserve train-pt --recipe small        # both models, about 20 minutes in all on 2 cores
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from trtserve.models.parallel_track import SEPARATOR, PTConfig, corpus, to_compact, tokenizer_dir  # noqa: F401
from trtserve.progress import say

RECIPE_VERSION = 2  # bump when the training code changes what a recipe produces


@dataclass(frozen=True)
class Recipe:
    name: str
    vocab: int  # compact vocabulary size, the unknown id included
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    n_tracks: int
    block_depth: int
    steps: int
    batch: int
    seq: int
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0

    def config(self, kind: str, vocab_size: int) -> PTConfig:
        tracks, depth = (self.n_tracks, self.block_depth) if kind == "pt" else (1, 1)
        return PTConfig(vocab_size=vocab_size, hidden_size=self.hidden, num_layers=self.layers,
                        num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
                        intermediate_size=self.ffn, n_tracks=tracks, block_depth=depth, max_positions=self.seq * 8)

    def key(self) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "v": RECIPE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


RECIPES = {
    # 4 tracks, 8 layers, D = 4 against a dense model of the same widths (the same parameters but
    # for the per-track norm weights).
    "small": Recipe("small", vocab=16385, hidden=128, layers=8, heads=4, kv_heads=4, head_dim=32, ffn=512,
                    n_tracks=4, block_depth=4, steps=600, batch=16, seq=128),
    # The test suite's model: trained for seconds, enough to be a real (if weak) language model.
    "tiny": Recipe("tiny", vocab=4097, hidden=64, layers=8, heads=4, kv_heads=4, head_dim=16, ffn=256,
                   n_tracks=4, block_depth=4, steps=150, batch=8, seq=64),
}


def compact_vocab(train: list[int], size: int):
    """Tokenizer ids of compact ids 1..size-1: the most frequent in the training stream (0 is unknown)."""
    import torch

    common = [token for token, _ in Counter(train).most_common(size - 1)]
    return torch.tensor([-1] + common, dtype=torch.long)


def perplexity(model, stream, seq: int, windows: int = 64) -> float:
    """exp(mean next-token NLL) over up to `windows` consecutive windows of `seq` tokens."""
    import torch
    from torch.nn import functional as F

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for w in range(min(windows, (len(stream) - 1) // seq)):
            chunk = stream[w * seq:(w + 1) * seq + 1]
            logits, _ = model(chunk[None, :-1])
            total += F.cross_entropy(logits[0], chunk[1:], reduction="sum").item()
            count += seq
    return math.exp(total / count)


def train(recipe: Recipe, kind: str, out: Path) -> dict:
    """Train one model (`pt` or `dense`) and save it to `out`; return its results."""
    import torch
    from torch.nn import functional as F

    from trtserve.models.pt_model import ParallelTrackModel, count_parameters, save_checkpoint

    torch.manual_seed(recipe.seed)
    train_ids, held_ids = corpus()
    vocab = compact_vocab(train_ids, recipe.vocab)
    train_stream, held_stream = to_compact(train_ids, vocab), to_compact(held_ids, vocab)
    cfg = recipe.config(kind, recipe.vocab)
    model = ParallelTrackModel(cfg, vocab=vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(recipe.seed)  # the same batches for both models
    started, losses = time.time(), []
    for step in range(recipe.steps):
        lr = recipe.lr * min(1.0, (step + 1) / recipe.warmup)
        lr *= 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(train_stream) - recipe.seq - 1, (recipe.batch,), generator=generator)
        batch = torch.stack([train_stream[s:s + recipe.seq + 1] for s in starts.tolist()])
        model.train()
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab_size), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) % max(1, recipe.steps // 10) == 0:
            say(f"train {recipe.name}/{kind}: step {step + 1}/{recipe.steps} loss "
                f"{sum(losses[-20:]) / len(losses[-20:]):.3f} ({time.time() - started:.0f} s)")
    seconds = time.time() - started
    results = {"kind": kind, "recipe": dataclasses.asdict(recipe), "parameters": count_parameters(model),
               "train_seconds": round(seconds, 1), "final_train_loss": round(sum(losses[-20:]) / 20, 4),
               "heldout_perplexity": round(perplexity(model, held_stream, recipe.seq), 3),
               "heldout_tokens": min(64, (len(held_stream) - 1) // recipe.seq) * recipe.seq,
               "unknown_rate_heldout": round(float((held_stream == 0).float().mean()), 4)}
    from tokenizers import Tokenizer

    separator = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json")).token_to_id(SEPARATOR)
    model.cfg = dataclasses.replace(cfg, extra=results, eos_token_id=separator)
    save_checkpoint(model, out, tokenizer_dir())
    return results


def checkpoint(recipe_name: str, kind: str) -> Path:
    """The cached checkpoint of a recipe's model, trained on first use."""
    from trtserve.fileio import cache_root

    recipe = RECIPES[recipe_name]
    out = cache_root() / "models" / "parallel-track" / f"{recipe.name}-{kind}-{recipe.key()}"
    if not (out / "config.json").is_file():
        say(f"training the {recipe.name} {kind} model into {out} (once)")
        train(recipe, kind, out)
    return out


def results(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text()).get("extra", {})
