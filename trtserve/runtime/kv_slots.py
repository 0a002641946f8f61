"""Sequence slots over the ONNX Runtime decode graph (engine_builder.kv_graph): per layer one key and one
value buffer (slots, Hkv, length, D), bound through IOBinding as both the past input and the present
output of a call, so ONNX Runtime appends each call's new rows in place. A call covers a contiguous range
of slots; each row brings 0 (idle) or more new tokens, right-padded. Nothing is copied per step; `move`
copies one sequence's rows when the caller compacts its slots."""

from __future__ import annotations

import mmap

import numpy as np

from trtserve.errors import InputError

KV_GRAPH = "model.kv.onnx"
_BINDINGS_KEPT = 64  # slot ranges with a binding kept (the batcher uses a few: its slots are packed at the front)
_CACHE_TYPES = {"tensor(float)": np.float32, "tensor(int8)": np.int8}
QUERY_LENS, SEQLENS, TOTAL, LOGIT_INDEX = "query_seqlens", "seqlens_k", "total_sequence_length", "logit_index"


def kv_graph_of(engine) -> str | None:
    """The engine's decode graph file, when its build made and checked one."""
    entry = engine.manifest.kv_graph
    return entry.file if entry and entry.file == KV_GRAPH and engine.file(KV_GRAPH).is_file() else None


def checked_lengths(slots, first: int, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens cached in slots [first, first + len(counts)) of `slots` (anything with slots, length and capacity)
    before and after a call feeds them `counts` more; InputError for slots out of range or a context overrun."""
    rows = len(counts)
    if first < 0 or first + rows > slots.slots:
        raise InputError(f"slots {first}..{first + rows - 1} are outside 0..{slots.slots - 1}")
    before = slots.length[first:first + rows]
    after = before + counts
    if (after > slots.capacity).any():
        raise InputError(f"a sequence would hold {int(after.max())} tokens, the cache holds {slots.capacity}")
    return before, after


_RELEASABLE = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MADV_DONTNEED")  # POSIX (Linux, macOS)


def _zeros(shape: tuple, dtype) -> tuple[np.ndarray, mmap.mmap | None]:
    """Zeros in a private anonymous mapping of their own, and the mapping: the OS gives a page memory
    only when it is written, whatever malloc's thresholds (glibc serves a buffer of a size it has freed before
    from its heap, zeroing, and so touching, every page). Unmapped when the array and the mapping go. Plain
    zeros (no mapping) where the platform has no private mappings."""
    if not _RELEASABLE:
        return np.zeros(shape, dtype), None
    count = int(np.prod(shape))
    mapping = mmap.mmap(-1, max(np.dtype(dtype).itemsize * count, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(mapping, dtype, count=count).reshape(shape), mapping


class KVSlots:
    def __init__(self, engine, slots: int, threads: int | None = None, session=None, initial: int = 256):
        """`initial`: the buffers' first length; they grow by doubling up to the engine's context as the longest
        sequence needs (ONNX Runtime's attention scratch is sized by the buffers' length, so a short batch stays
        small)."""
        import onnxruntime as ort

        from trtserve.runtime.base import available_cores

        if session is None:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads or available_cores()
            options.inter_op_num_threads = 1
            options.log_severity_level = 3
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # optimized at build
            session = ort.InferenceSession(str(engine.file(KV_GRAPH)), options, providers=["CPUExecutionProvider"])
        self.session = session
        self.capacity = engine.manifest.shapes.total_sequence.max
        self.slots = slots
        self.names = [i.name for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        shapes = {i.name: i.shape for i in session.get_inputs()}
        # the cache's element type as the graph declares it: float32 from the builder, int8 where a quantized
        # cache is probed (benchmarks/probes/probe_kv_int8.py)
        self.dtype = _CACHE_TYPES[next(i.type for i in session.get_inputs() if i.name == self.names[0])]
        self.allocated = min(initial, self.capacity)  # the buffers' length axis now
        self.buffers, self._mappings = {}, {}
        for n in self.names:
            self.buffers[n], self._mappings[n] = _zeros((slots, shapes[n][1], self.allocated, shapes[n][3]), self.dtype)
        self.length = np.zeros(slots, np.int64)  # tokens cached per slot
        self.vocab = engine.manifest.model.architecture.vocab_size  # the logits' last axis
        # IOBinding per slot range with the buffers bound as past and present: binding 4 tensors per layer costs
        # about 1 ms a call in Python, so a decode step rebinds only its small inputs and the logits.
        self._bindings: dict[tuple[int, int], object] = {}

    def _grow(self, need: int) -> None:
        """Longer buffers (doubling, at most the engine's context), every slot's cached rows copied over. Only
        those rows: the new buffers' other pages stay untouched, so memory follows the tokens cached, not
        slots x length (one 2,000-token sequence among 16 slots of SmolLM2 held 1.5 GB when whole buffers
        were copied)."""
        size = self.allocated
        while size < need:
            size *= 2
        size = min(size, self.capacity)
        live = [(int(slot), int(self.length[slot])) for slot in np.flatnonzero(self.length)]
        for name, old in self.buffers.items():
            new, self._mappings[name] = _zeros(old.shape[:2] + (size,) + old.shape[3:], self.dtype)
            for slot, n in live:
                new[slot, :, :n] = old[slot, :, :n]
            self.buffers[name] = new
        self.allocated = size
        self._bindings.clear()  # they point at the old buffers

    def run(self, first: int, ids: np.ndarray, counts: np.ndarray, logit_index: np.ndarray) -> np.ndarray:
        """Feed slots [first, first + B) their new tokens: ids (B, S) right-padded, counts (B,) real tokens per
        row (0: idle), logit_index (B, K) positions within the S new ones. Returns logits (B, K, V)."""
        rows, width = ids.shape
        before, after = checked_lengths(self, first, counts)
        if (after < 1).any():
            raise InputError("an idle row has no cached tokens")
        if rows > 1 and (before + width > self.capacity).any():
            return self._row_by_row(first, ids, counts, logit_index)  # the padded chunk would not fit a row
        if int((before + width).max()) > self.allocated:
            self._grow(int((before + width).max()))
        binding = self._binding(first, rows)
        feeds = {"input_ids": np.ascontiguousarray(ids, np.int64), QUERY_LENS: counts.astype(np.int32),
                 SEQLENS: (after - 1).astype(np.int32), TOTAL: np.array(max(int(after.max()), width), np.int32),
                 LOGIT_INDEX: np.ascontiguousarray(logit_index, np.int64)}
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        logits = np.empty((rows, logit_index.shape[1], self.vocab), np.float32)  # ONNX Runtime writes it
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        self.length[first:first + rows] = after
        return logits  # the logits alone: the presents are the buffers

    def _binding(self, first: int, rows: int):
        """The IOBinding of slots [first, first + rows) with their buffers bound as past and present."""
        binding = self._bindings.get((first, rows))
        if binding is None:
            if len(self._bindings) >= _BINDINGS_KEPT:
                self._bindings.clear()
            binding = self._bindings[(first, rows)] = self.session.io_binding()
            for name in self.names:
                view = self.buffers[name][first:first + rows]  # contiguous: slots are the leading axis
                binding.bind_input(name, "cpu", 0, self.dtype, list(view.shape), view.ctypes.data)
                binding.bind_output("present." + name[len("past_key_values."):], "cpu", 0, self.dtype,
                                    list(view.shape), view.ctypes.data)
        return binding

    def _row_by_row(self, first: int, ids: np.ndarray, counts: np.ndarray, logit_index: np.ndarray) -> np.ndarray:
        """The same call one row at a time, each with its own tokens unpadded (a row near the end of its cache
        has no room for a padded chunk)."""
        out = None
        for r in np.flatnonzero(counts):
            n = int(counts[r])
            logits = self.run(first + int(r), ids[r:r + 1, :n], counts[r:r + 1],
                              np.minimum(logit_index[r:r + 1], n - 1))
            out = np.zeros((len(ids), *logits.shape[1:]), logits.dtype) if out is None else out
            out[r] = logits[0]
        assert out is not None  # the batcher never calls with every row idle
        return out

    def move(self, source: int, target: int) -> None:
        """Slot `source`'s sequence into slot `target` (its cached rows only)."""
        if source == target:
            return
        n = int(self.length[source])
        for buffer in self.buffers.values():
            buffer[target, :, :n] = buffer[source, :, :n]
        self.length[target] = n
        self.clear(source)

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots' sequences (their cached rows only)."""
        n, m = int(self.length[a]), int(self.length[b])
        for buffer in self.buffers.values():
            kept = buffer[a, :, :n].copy()
            buffer[a, :, :m] = buffer[b, :, :m]
            buffer[b, :, :n] = kept
        self.length[a], self.length[b] = m, n

    def clear(self, slot: int) -> None:
        """Empty `slot` and give its pages back to the OS (they read as zeros again), so a worker's memory
        follows the tokens it holds now, not the most it ever held."""
        if self.length[slot] == 0:
            return
        self.length[slot] = 0
        for name, buffer in self.buffers.items():
            base, row = self._mappings[name], buffer[slot]  # contiguous: slots are the leading axis
            offset = row.ctypes.data - buffer.ctypes.data
            start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the slot's rows only
            stop = (offset + row.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
            if stop > start and base is not None:
                base.madvise(mmap.MADV_DONTNEED, start, stop - start)

    def read(self, slot: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """A copy of `slot`'s cached rows [start, stop): past name -> (Hkv, stop - start, D)."""
        if not 0 <= start <= stop <= self.length[slot]:
            raise InputError(f"rows {start}..{stop} are not all cached in slot {slot} ({self.length[slot]} are)")
        return {name: buffer[slot, :, start:stop].copy() for name, buffer in self.buffers.items()}

    def write(self, slot: int, rows: dict[str, np.ndarray]) -> None:
        """Make `rows` (past name -> (Hkv, n, D)) the first n cached rows of an empty `slot`."""
        n = next(iter(rows.values())).shape[1]
        if n > self.capacity:
            raise InputError(f"{n} rows do not fit the cache of {self.capacity}")
        if n > self.allocated:
            self._grow(n)
        for name, buffer in self.buffers.items():
            buffer[slot, :, :n] = rows[name]
        self.length[slot] = n
