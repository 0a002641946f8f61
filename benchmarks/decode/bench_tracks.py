"""Parallel tracks against tensor parallelism, in one run: time to first token and time per output
token of the trained PT model (sharded by track) and the dense model of the same size (sharded
Megatron-style), on 2 and 4 CPU worker processes joined by torch.distributed (gloo), with the
all-reduces each forward makes. The single-process torch reference of each model is the baseline.
Both layouts run the same torch code; `--engines` adds the PT model's ONNX Runtime track engines.

    .venv/bin/python -m benchmarks.decode.bench_tracks [--recipe small] [--prompt 128] [--new 32] \\
        [--repeats 3] [--engines]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from trtserve.deploy.engines import engine_for
from trtserve.models.pt_model import load_checkpoint
from trtserve.research.pt_train import checkpoint, results, to_compact
from trtserve.research.torch_shards import torch_decoder
from trtserve.runtime.sharded import ShardedDecoder


def prompt_ids(path: Path, length: int) -> np.ndarray:
    from tokenizers import Tokenizer

    from trtserve.data.corpus import wiki_text

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(wiki_text(length * 2, start=5000), add_special_tokens=False).ids[:length]
    return to_compact(ids, load_checkpoint(path).vocab)[None].numpy()


def measure(step_prefill, step_decode, prompt, new: int, repeats: int) -> tuple[float, float, int]:
    """(median TTFT s, median TPOT s, syncs per forward) over `repeats` runs after one warm-up."""
    ttft, tpot, syncs = [], [], 0
    for run in range(repeats + 1):
        first = step_prefill(prompt)
        token, times = first.logits.argmax(-1)[:, None], []
        for _ in range(new):
            step = step_decode(token)
            times.append(step.seconds)
            token = step.logits.argmax(-1)[:, None]
        if run:  # the first run warms up
            ttft.append(first.seconds)
            tpot.append(sum(times) / len(times))
        syncs = step.syncs
    return statistics.median(ttft), statistics.median(tpot), syncs


class Reference:
    """The single-process torch model, with the sharded decoder's step interface."""

    def __init__(self, path: Path, threads: int):
        torch.set_num_threads(threads)
        self.model, self.past = load_checkpoint(path), None

    def _run(self, ids, past):
        from trtserve.runtime.sharded import Step

        started, before = time.perf_counter(), self.model.syncs
        with torch.no_grad():
            logits, self.past = self.model(torch.as_tensor(ids), past)
        return Step(logits[:, -1].numpy(), self.model.syncs - before, time.perf_counter() - started)

    def prefill(self, ids):
        return self._run(ids, None)

    def decode(self, ids):
        return self._run(ids, self.past)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="small")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--engines", action="store_true",
                        help="also run the PT model's track-sharded ONNX Runtime engines (built once, cached)")
    args = parser.parse_args()
    paths = {"pt": checkpoint(args.recipe, "pt"), "tp": checkpoint(args.recipe, "dense")}
    cfg = {mode: load_checkpoint(p).cfg for mode, p in paths.items()}
    prompt = prompt_ids(paths["pt"], args.prompt)
    print(f"recipe {args.recipe}: PT {cfg['pt'].n_tracks} tracks x {cfg['pt'].num_layers} layers, D = "
          f"{cfg['pt'].block_depth} ({results(paths['pt'])['parameters']:,} parameters); dense "
          f"{cfg['tp'].num_layers} layers ({results(paths['tp'])['parameters']:,}); prompt {prompt.shape[1]} "
          f"tokens, {args.new} new, batch 1, {args.threads} thread(s) per process, median of {args.repeats}")
    print(f"{'workers':>7} {'layout':>6} {'syncs/fwd':>9} {'TTFT ms':>9} {'TPOT ms':>9}")
    for mode in ("pt", "tp"):
        ttft, tpot, syncs = measure(*_steps(Reference(paths[mode], args.threads)), prompt, args.new, args.repeats)
        print(f"{1:>7} {mode + '-ref':>6} {syncs:>9} {ttft * 1e3:9.2f} {tpot * 1e3:9.2f}")
    engine = engine_for(str(paths["pt"])) if args.engines else None
    for world in args.workers:
        row = {}
        layouts = [("pt", paths["pt"]), ("tp", paths["tp"])] + ([("pt-ort", engine)] if engine else [])
        for name, path in layouts:
            sharded = ShardedDecoder(path, world, args.threads) if name == "pt-ort" else \
                torch_decoder(path, world, name, args.threads)
            with sharded as decoder:
                row[name] = measure(decoder.prefill, decoder.decode, prompt, args.new, args.repeats)
            ttft, tpot, syncs = row[name]
            print(f"{world:>7} {name:>6} {syncs:>9} {ttft * 1e3:9.2f} {tpot * 1e3:9.2f}")
        print(f"{world:>7} {'TP/PT':>6} {row['tp'][2] / row['pt'][2]:>9.1f} {row['tp'][0] / row['pt'][0]:9.2f}x "
              f"{row['tp'][1] / row['pt'][1]:8.2f}x")


def _steps(obj):
    return obj.prefill, obj.decode


if __name__ == "__main__":
    main()
