"""Resident memory of a worker's decode path holding sequences: the engine loaded as a server worker loads
it (its backend and the slot batcher's KV slots), then `--sequences` sequences of `--tokens` random ids fed
into the first slots in chunks of `--chunk`; prints the process's resident set (VmRSS) after loading and
after filling and once the sequences ended, and the bytes of cached rows themselves.

    .venv/bin/python -m benchmarks.decode.kv_memory --engine engines/smollm2-int4 --slots 16 --sequences 1 --tokens 2000
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def main() -> None:
    from trtserve.runtime import load_backend
    from trtserve.runtime.slot_batching import make_batcher
    from trtserve.runtime.text import TextEngine

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True)
    parser.add_argument("--slots", type=int, default=16, help="the worker's --max-num-seqs")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.sequences > args.slots:
        sys.exit("--sequences must not exceed --slots")
    started = resident_mb()
    text = TextEngine(load_backend(args.engine, threads=args.threads))
    batcher = make_batcher(text.backend, text.eos_ids, args.slots)
    slots = getattr(batcher, "slots", None)
    if slots is None:
        sys.exit(f"{args.engine} has no decode graph")
    loaded = resident_mb()
    rng = np.random.default_rng(0)
    for slot in range(args.sequences):
        ids = rng.integers(0, slots.vocab, args.tokens)
        for start in range(0, args.tokens, args.chunk):
            part = ids[start:start + args.chunk][None]
            slots.run(slot, part, np.array([part.shape[1]]), np.array([[part.shape[1] - 1]]))
    filled = resident_mb()
    for slot in range(args.sequences):
        slots.clear(slot)  # the sequences end
    ended = resident_mb()
    rows = sum(b[0, :, :1].nbytes for b in slots.buffers.values()) * args.sequences * args.tokens / 2**20
    print(f"engine {args.engine}, {args.slots} slots, {args.sequences} sequences x {args.tokens} tokens")
    print(f"resident: {started:.0f} MiB before loading, {loaded:.0f} MiB loaded, {filled:.0f} MiB filled "
          f"(+{filled - loaded:.0f} MiB; the cached rows are {rows:.0f} MiB), {ended:.0f} MiB once they ended")


if __name__ == "__main__":
    main()
