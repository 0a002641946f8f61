"""Automatic prefix caching for the slot batcher (runtime/slot_batching.py): the KV rows of prompt
prefixes, kept in blocks of BLOCK tokens keyed by their tokens and the block before them (as vLLM's
automatic prefix caching hashes blocks), so that a prompt that starts like an earlier one (a system
prompt, a chat history, few-shot examples) copies those rows into its slot instead of prefilling them.

A block's key is (the id of the block before it, its tokens): exact, never a hash collision. A prompt
reuses its longest run of cached full blocks, leaving at least its last token to prefill (the next
token's logits come from it). Memory is bounded: the least recently used block that no other block
extends goes first, so a cached block's prefix is always cached too. Rows are stored as the engine computes
them (float32); at a position, a key and value depend only on the tokens up to it, so reused rows are the
rows a prefill would write."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

BLOCK = 16


@dataclass
class _Block:
    id: int
    parent: int  # the id of the block before it; -1 for a prompt's first block
    rows: dict  # past name -> (Hkv, BLOCK, D)
    children: int = 0  # cached blocks that extend it


class PrefixCache:
    def __init__(self, capacity_bytes: int, block: int = BLOCK):
        self.capacity, self.block = capacity_bytes, block
        self.blocks: OrderedDict[tuple, _Block] = OrderedDict()  # least recently used first
        self.by_id: dict[int, tuple] = {}
        self.size = 0  # bytes held
        self.queries = self.hits = 0  # prompt tokens looked up, and found cached
        self._ids = 0

    def _chain(self, prompt: list[int], limit: int) -> list[tuple]:
        """Keys of the cached full blocks that start `prompt`, at most `limit` tokens."""
        keys, parent = [], -1
        for start in range(0, limit - self.block + 1, self.block):
            key = (parent, tuple(prompt[start:start + self.block]))
            found = self.blocks.get(key)
            if found is None:
                break
            keys.append(key)
            parent = found.id
        return keys

    def _touch(self, keys: list[tuple]) -> None:
        for key in keys:
            self.blocks.move_to_end(key)

    def load(self, slots, slot: int, prompt: list[int]) -> int:
        """Copy the longest cached prefix of `prompt` (leaving its last token) into `slot`; its length."""
        keys = self._chain(prompt, len(prompt) - 1)
        self.queries += len(prompt)
        if not keys:
            return 0
        self._touch(keys)
        n = len(keys) * self.block
        slots.write(slot, {name: np.concatenate([self.blocks[k].rows[name] for k in keys], axis=1)
                           for name in slots.names})
        self.hits += n
        return n

    def store(self, slots, slot: int, prompt: list[int]) -> None:
        """Keep the full blocks of `prompt`, whose rows `slot` now holds, that are not cached yet."""
        full = (len(prompt) // self.block) * self.block
        known = self._chain(prompt, full)
        parent = self.blocks[known[-1]].id if known else -1
        start = len(known) * self.block
        if start < full:
            rows = slots.read(slot, start, full)
            per_block = sum(r.nbytes for r in rows.values()) // ((full - start) // self.block)
            self._touch(known)  # its chain is the last to go
            for offset in range(start, full, self.block):
                while self.size + per_block > self.capacity:
                    if not self._evict(keep=set(known)):
                        return  # nothing else can go: keep what is cached
                key = (parent, tuple(prompt[offset:offset + self.block]))
                self._ids += 1
                local = slice(offset - start, offset - start + self.block)
                self.blocks[key] = _Block(self._ids, parent, {n: r[:, local].copy() for n, r in rows.items()})
                self.by_id[self._ids] = key
                if parent >= 0:
                    self.blocks[self.by_id[parent]].children += 1
                self.size += per_block
                parent = self._ids
                known.append(key)
        self._touch(known)

    def _evict(self, keep: set) -> bool:
        """Drop the least recently used block that nothing extends (not one of `keep`); whether one went."""
        key = next((k for k, b in self.blocks.items() if b.children == 0 and k not in keep), None)
        if key is None:
            return False
        gone = self.blocks.pop(key)
        del self.by_id[gone.id]
        if gone.parent >= 0:
            self.blocks[self.by_id[gone.parent]].children -= 1
        self.size -= sum(r.nbytes for r in gone.rows.values())
        return True

    def stats(self) -> dict:
        return {"queries": self.queries, "hits": self.hits, "blocks": len(self.blocks), "bytes": self.size}
