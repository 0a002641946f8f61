"""The decode graph (engine_builder.kv_graph) on a tiny random Llama exported by the real exporter: the
lowering finds every layer's attention, ONNX Runtime appends to the slot buffers in place, and the slot
batcher gives the padded batcher's tokens, chunked or not, with sequences joining and leaving."""

from __future__ import annotations

import json
import mmap
import os

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install torch==2.13.0) to export the tiny model")
transformers = pytest.importorskip("transformers", reason="needs transformers to make the tiny model")

from trtserve.engine_builder.kv_graph import NotLowered, build_kv, lower  # noqa: E402
from trtserve.engine_dir import EngineDir  # noqa: E402
from trtserve.engine_dir.manifest import KvGraph  # noqa: E402
from trtserve.runtime.batching import ContinuousBatcher  # noqa: E402
from trtserve.runtime.kv_slots import KV_GRAPH  # noqa: E402
from trtserve.runtime.ort import OrtBackend  # noqa: E402
from trtserve.runtime.sampling import SamplingParams  # noqa: E402
from trtserve.runtime.slot_batching import SlotBatcher, make_batcher  # noqa: E402

CAPACITY = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> EngineDir:
    """A 2-layer Llama (4 query heads over 2 KV heads) exported and optimized as a build does, decode graph included."""
    from trtserve.engine_builder.build import _io_from_graph, _shape_ranges
    from trtserve.engine_builder.export import export_onnx
    from trtserve.engine_builder.onnxruntime import build_ort
    from trtserve.models.loading import load_torch_model
    from trtserve.models.sources import resolve

    root = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CAPACITY,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "checkpoint")
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({f"t{i}": i for i in range(96)}, unk_token="t0")).save(
        str(root / "checkpoint" / "tokenizer.json"))
    source = resolve(str(root / "checkpoint"))
    engine_dir = root / "engine"
    engine_dir.mkdir()
    export_onnx(source, load_torch_model(source), engine_dir / "model.onnx")
    manifest = {"model": {"id": "tiny", "kind": "decoder", "source": str(source.path),
                          "architecture": vars(source.info)},
                "io": _io_from_graph(engine_dir / "model.onnx"), "shapes": _shape_ranges(source, 4, CAPACITY),
                "onnx": {"file": "model.onnx", "sha256": "-", "opset": 0, "exporter": "-", "fp32_export_cache": "-"}}
    manifest["backend"] = build_ort(engine_dir / "model.onnx", engine_dir)
    manifest["backend"]["kv_graph"] = build_kv(engine_dir, manifest)
    (engine_dir / "manifest.json").write_text(json.dumps(manifest))
    return EngineDir(engine_dir, manifest)


def test_every_layer_becomes_one_attention_node_and_the_build_check_passes(tiny):
    entry = tiny.manifest.kv_graph
    assert entry.file == KV_GRAPH, entry
    assert entry.check["max_relative_difference"] < 1e-4
    graph = onnx.load(str(tiny.file(KV_GRAPH))).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("GroupQueryAttention") == 2
    assert not {"Softmax", "Sin", "Cos"} & set(ops)  # rotary and softmax live inside the attention nodes
    producers = {o: n for n in graph.node for o in n.output}
    for attention in (n for n in graph.node if n.op_type == "GroupQueryAttention"):
        # fp32 weights: query, key and value are one packed product (key and value inputs left empty)
        assert list(attention.input[1:3]) == ["", ""] and producers[attention.input[0]].op_type == "MatMul"
    assert {i.name for i in graph.input} >= {"input_ids", "query_seqlens", "seqlens_k", "logit_index"}
    assert "attention_mask" not in {i.name for i in graph.input}


def test_a_query_key_value_product_split_three_ways_is_read_whole(tiny, tmp_path):
    """Quantized weights reach the lowering as one product split in three (precision.blocked fuses GEMMs that
    share their input): the attention reads the product packed, and the Split goes."""
    from trtserve.engine_builder.onnxruntime import build_ort
    from trtserve.precision.blocked import weight_rows

    model = onnx.load(str(tiny.file("model.onnx")))
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    by_input = {}
    for node in graph.node:
        rows = weight_rows(node.input[1], inits, producers)[0] if node.op_type == "MatMul" else None
        if rows is not None:
            by_input.setdefault(node.input[0], []).append((node, rows))
    groups = [g for g in by_input.values() if len(g) == 3]  # each layer's query, key and value
    assert len(groups) == 2
    for layer, group in enumerate(groups):
        joined = np.concatenate([rows for _, rows in group]).T.copy()
        graph.initializer.append(onnx.numpy_helper.from_array(joined, f"qkv{layer}"))
        graph.initializer.append(onnx.numpy_helper.from_array(np.array([r.shape[0] for _, r in group]),
                                                              f"sizes{layer}"))
        first = group[0][0]
        at = list(graph.node).index(first)
        graph.node.insert(at, onnx.helper.make_node("Split", [f"joined{layer}", f"sizes{layer}"],
                                                    [n.output[0] for n, _ in group], axis=-1))
        graph.node.insert(at, onnx.helper.make_node("MatMul", [first.input[0], f"qkv{layer}"], [f"joined{layer}"]))
        for node, _ in group:
            graph.node.remove(node)
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    onnx.save(model, str(engine_dir / "model.onnx"))
    manifest = {**tiny.manifest.model_dump(mode="json"), "backend": build_ort(engine_dir / "model.onnx", engine_dir)}
    entry = build_kv(engine_dir, manifest)
    assert entry["file"] == KV_GRAPH and entry["check"]["max_relative_difference"] < 1e-4, entry
    lowered = onnx.load(str(engine_dir / KV_GRAPH)).graph
    assert "Split" not in {n.op_type for n in lowered.node}
    attentions = [n for n in lowered.node if n.op_type == "GroupQueryAttention"]
    assert len(attentions) == 2 and all(list(n.input[1:3]) == ["", ""] for n in attentions)


def test_a_graph_without_the_pattern_is_refused_with_the_reason(tiny):
    model = onnx.load(str(tiny.file("model.onnx")))
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    softmax.op_type = "LogSoftmax"
    with pytest.raises(NotLowered, match="softmax"):
        lower(model, 4, 2, 16, CAPACITY)


def test_decode_steps_append_in_place(tiny):
    backend = OrtBackend(tiny, threads=1)
    slots = backend.kv_slots(2)
    buffer = slots.buffers["past_key_values.0.key"]
    address = buffer.ctypes.data
    slots.run(0, np.array([[5, 6, 7], [8, 0, 0]]), np.array([3, 1]), np.array([[2], [0]]))
    before = buffer[0, :, :3].copy()
    slots.run(0, np.array([[9], [10]]), np.array([1, 1]), np.zeros((2, 1), np.int64))
    assert buffer.ctypes.data == address and list(slots.length) == [4, 2]
    np.testing.assert_array_equal(buffer[0, :, :3], before)  # the cached rows stay where they were
    assert np.abs(buffer[0, :, 3]).sum() > 0 and np.abs(buffer[0, :, 4:]).sum() == 0


def _tokens(batcher, prompts, late, join_at=2):
    out = {}
    for i, p in enumerate(prompts):
        batcher.add(str(i), p, SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True))
    steps = 0
    while batcher.has_work():
        for event in batcher.step():
            assert event.error is None, event.error
            out.setdefault(event.id, []).append(event.token)
        steps += 1
        if steps == join_at:
            for i, p in enumerate(late, len(prompts)):
                batcher.add(str(i), p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    return out


@pytest.mark.parametrize("chunk", [None, 6, 1])
def test_slot_batcher_gives_the_padded_batchers_tokens_as_sequences_join_and_leave(tiny, chunk):
    backend = OrtBackend(tiny, threads=1)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 96, n)) for n in (9, 3, 14)]
    late = [list(rng.integers(0, 96, n)) for n in (5, 20)]
    want = _tokens(ContinuousBatcher(backend, {95}, 3, 4096), prompts, late)
    batcher = make_batcher(backend, {95}, 3, 4096, max_prefill_tokens=chunk)
    assert isinstance(batcher, SlotBatcher)
    assert _tokens(batcher, prompts, late) == want
    assert batcher.table == [] and not batcher.slots.length.any()


def test_prompt_logprobs_through_the_slots_equal_the_padded_path(tiny):
    backend = OrtBackend(tiny, threads=1)
    prompt = list(np.random.default_rng(4).integers(0, 96, 11))

    def first_event(batcher):
        batcher.add("a", prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
        events = []
        while batcher.has_work():
            events += batcher.step()
        return events[0]

    want = first_event(ContinuousBatcher(backend, {95}, 2, 4096))
    got = first_event(SlotBatcher(backend, {95}, 2, 4096, max_prefill_tokens=4))
    assert got.token == want.token
    assert len(got.prompt_logprobs) == len(prompt) and got.prompt_logprobs[0] == want.prompt_logprobs[0]
    for (token, logprob, top), (want_token, want_logprob, want_top) in zip(got.prompt_logprobs[1:],
                                                                           want.prompt_logprobs[1:]):
        assert token == want_token and logprob == pytest.approx(want_logprob, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in want_top]


def test_newcomers_join_while_others_prefill_and_the_oldest_is_fed_first(tiny):
    backend = OrtBackend(tiny, threads=1)
    rng = np.random.default_rng(8)
    batcher = SlotBatcher(backend, {95}, 4, 4096, max_prefill_tokens=8)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    batcher.add("a", list(rng.integers(0, 96, 20)), params)
    batcher.step()
    assert [s.length for s in batcher.table] == [8]  # the whole budget to the only newcomer
    batcher.add("b", list(rng.integers(0, 96, 20)), params)
    batcher.step()  # b is admitted though a is still prefilling; a, the oldest, takes the budget
    assert [(s.id, s.length) for s in batcher.table] == [("a", 16), ("b", 0)]
    events = batcher.step()  # a's last 4 tokens and b's first 4 (rows x width within the budget), then a decodes
    assert [(s.id, s.length) for s in batcher.table] == [("a", 21), ("b", 4)] and batcher.d == 1
    assert [e.id for e in events] == ["a", "a"]


def test_prompt_logprobs_are_right_when_fed_behind_others_and_after_a_cancel(tiny):
    backend = OrtBackend(tiny, threads=1)
    rng = np.random.default_rng(9)
    prompt, other = list(rng.integers(0, 96, 11)), list(rng.integers(0, 96, 17))
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    want = []
    alone = ContinuousBatcher(backend, {95}, 2, 4096)
    alone.add("s", prompt, scored)
    while alone.has_work():
        want += alone.step()
    batcher = SlotBatcher(backend, {95}, 3, 4096, max_prefill_tokens=4)
    batcher.add("gone", other, scored)
    batcher.step()
    batcher.cancel("gone")  # its prompt logits so far must not reach the next scored sequence
    batcher.add("x", other, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    batcher.step()
    batcher.add("s", prompt, scored)
    got = []
    while batcher.has_work():
        got += [e for e in batcher.step() if e.id == "s"]
    assert got[0].token == want[0].token and len(got[0].prompt_logprobs) == len(prompt)
    for (token, logprob, _), (want_token, want_logprob, _) in zip(got[0].prompt_logprobs[1:],
                                                                  want[0].prompt_logprobs[1:]):
        assert token == want_token and logprob == pytest.approx(want_logprob, abs=1e-4)


def test_a_row_too_close_to_the_end_of_its_cache_is_fed_alone(tiny):
    backend = OrtBackend(tiny, threads=1)
    slots = backend.kv_slots(2)
    rng = np.random.default_rng(5)
    long, short = rng.integers(0, 96, CAPACITY - 2), rng.integers(0, 96, 8)
    slots.run(0, long[None, :-1], np.array([CAPACITY - 3]), np.array([[CAPACITY - 4]]))
    ids = np.zeros((2, 8), np.int64)
    ids[0, 0], ids[1] = long[-1], short
    logits = slots.run(0, ids, np.array([1, 8]), np.array([[0], [7]]))  # 61 + 8 padded rows would not fit slot 0
    assert list(slots.length) == [CAPACITY - 2, 8] and np.isfinite(logits).all()


def test_engines_without_a_decode_graph_keep_the_padded_batcher(tiny):
    backend = tiny.manifest.backend.model_copy(
        update={"kv_graph": KvGraph(file=None, why_not="built before the decode graph")})
    without = EngineDir(tiny.path, tiny.manifest.model_copy(update={"backend": backend}))
    batcher = make_batcher(OrtBackend(without, threads=1), {95}, 2)
    assert type(batcher) is ContinuousBatcher


def test_buffers_grow_as_the_longest_sequence_needs_and_keep_every_row(tiny):
    from trtserve.runtime.kv_slots import KVSlots

    rng = np.random.default_rng(6)
    prompts = rng.integers(0, 96, (2, 30))
    results = []
    for initial in (4, CAPACITY):
        slots = KVSlots(tiny, 2, threads=1, initial=initial)
        out = [slots.run(0, prompts[:, :3], np.array([3, 3]), np.array([[2], [2]]))]
        out.append(slots.run(1, prompts[1:, 3:30], np.array([27]), np.array([[26]])))  # slot 1 alone past 4
        out.append(slots.run(0, prompts[:, :1], np.array([1, 1]), np.zeros((2, 1), np.int64)))
        results.append((slots.allocated, out))
    (grown, small), (full, big) = results
    assert grown == 32 and full == CAPACITY
    for a, b in zip(small, big):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _resident_bytes(array: np.ndarray) -> int:
    """Bytes of the pages under `array` that are in memory, from /proc/self/pagemap (bit 63 of each page's entry)."""
    import struct

    first = array.ctypes.data // mmap.PAGESIZE
    last = (array.ctypes.data + array.nbytes - 1) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = struct.unpack(f"{last - first + 1}Q", pagemap.read((last - first + 1) * 8))
    return sum(entry >> 63 for entry in entries) * mmap.PAGESIZE


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_memory_follows_the_cached_rows_not_slots_times_length(tiny):
    from trtserve.runtime.kv_slots import KVSlots

    slots = KVSlots(tiny, 64, threads=1, initial=4)
    prompt = np.random.default_rng(9).integers(0, 96, (1, 40))
    for start in range(0, 40, 10):  # one sequence in slot 0 grows the buffers 4 -> 64 rows
        slots.run(0, prompt[:, start:start + 10], np.array([10]), np.array([[9]]))
    assert slots.allocated == CAPACITY
    page = mmap.PAGESIZE
    for buffer in slots.buffers.values():
        assert buffer.nbytes >= 64 * page  # 64 slots x 2 heads x 64 rows x 16 x 4 bytes
        # slot 0's rows: one page per head at most; the 63 idle slots hold none
        assert _resident_bytes(buffer) <= 2 * page, "idle slots' rows were written"
    slots.move(0, 5)  # the batcher compacting its slots: slot 0's pages go back to the OS
    assert all(_resident_bytes(b) <= 2 * page for b in slots.buffers.values())
    slots.clear(5)
    assert all(_resident_bytes(b) == 0 for b in slots.buffers.values()), "a cleared slot kept its pages"
    assert all(not b.any() for b in slots.buffers.values())  # they read as zeros (reading maps the zero page)


def test_kept_bindings_follow_moves_and_growth_and_leave_returned_logits_alone(tiny):
    from trtserve.runtime.kv_slots import KVSlots

    rng = np.random.default_rng(8)
    prompts = rng.integers(0, 96, (3, 12))

    def scenario(slots, fresh):
        out = []

        def run(*args):
            if fresh:
                slots._bindings.clear()  # a new IOBinding for every call
            out.append(slots.run(*args))
            return out[-1].copy()

        run(0, prompts[:, :3], np.array([3, 3, 3]), np.array([[2], [2], [2]]))
        for t in range(3, 6):
            run(0, prompts[:, t:t + 1], np.ones(3, np.int64), np.zeros((3, 1), np.int64))
        first = out[0].copy()
        slots.swap(0, 2)
        run(1, prompts[1:, 6:7], np.ones(2, np.int64), np.zeros((2, 1), np.int64))  # rows 1..2: prompt 1, prompt 0
        chunk = np.zeros((3, 5), np.int64)
        chunk[0], chunk[1:, 0] = prompts[0, 7:12], prompts[1:, 7]
        run(0, chunk, np.array([5, 1, 1]), np.array([[4], [0], [0]]))  # slot 0 grows past 8 rows: new buffers
        slots.move(1, 0)
        run(0, prompts[:1, 11:12], np.ones(1, np.int64), np.zeros((1, 1), np.int64))
        np.testing.assert_array_equal(out[0], first)  # later calls wrote into their own arrays
        assert slots.allocated == 16
        return out

    kept = scenario(KVSlots(tiny, 3, threads=1, initial=8), fresh=False)
    fresh = scenario(KVSlots(tiny, 3, threads=1, initial=8), fresh=True)
    assert len(kept) == len(fresh) == 7
    for a, b in zip(kept, fresh):
        np.testing.assert_array_equal(a, b)


def _one_by_one(batcher, prompts):
    out = []
    for i, p in enumerate(prompts):
        batcher.add(str(i), p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        tokens = []
        while batcher.has_work():
            tokens += [e.token for e in batcher.step()]
        out.append(tokens)
    return out


def test_prefix_cache_reuses_shared_prefixes_and_gives_the_same_tokens(tiny):
    from trtserve.runtime.prefix_cache import PrefixCache

    backend = OrtBackend(tiny, threads=1)
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, 96, 37)]
    prompts = [shared + [int(t) for t in rng.integers(0, 96, n)] for n in (3, 9)] + [shared, shared[:20]]
    want = _one_by_one(make_batcher(backend, {95}, 2, 4096, max_prefill_tokens=6), prompts)
    batcher = make_batcher(backend, {95}, 2, 4096, max_prefill_tokens=6)
    batcher.prefix_cache = cache = PrefixCache(1 << 20, block=8)
    assert _one_by_one(batcher, prompts) == want  # greedy: the same tokens with and without the cache
    # 32 of the shared 37 tokens reused by the second prompt and the third (its last token is prefilled),
    # 16 by the fourth; the first found nothing
    assert cache.hits == 32 + 32 + 16 and cache.queries == sum(map(len, prompts))
    assert not batcher.slots.length.any()


def test_prefix_cache_stays_within_its_bytes(tiny):
    from trtserve.runtime.prefix_cache import PrefixCache

    backend = OrtBackend(tiny, threads=1)
    batcher = make_batcher(backend, {95}, 2, 4096)
    per_block = sum(b[0, :, :8].nbytes for b in batcher.slots.buffers.values())
    batcher.prefix_cache = cache = PrefixCache(3 * per_block, block=8)
    rng = np.random.default_rng(6)
    prompts = [[int(t) for t in rng.integers(0, 96, 40)] for _ in range(3)]
    _one_by_one(batcher, prompts)
    assert cache.size <= 3 * per_block and len(cache.blocks) == 3
    assert all(parent == -1 or any(b.id == parent for b in cache.blocks.values())
               for parent, _ in cache.blocks)  # the leaves went first: every kept block's parent is kept


@pytest.mark.parametrize("slots", [True, False])
def test_a_prefills_first_tokens_are_handed_over_before_the_decode_call(tiny, slots):
    backend = OrtBackend(tiny, threads=1)
    rng = np.random.default_rng(11)
    prompts = {"a": list(rng.integers(0, 96, 6)), "b": list(rng.integers(0, 96, 9))}

    def run(with_early: bool):
        batcher = (SlotBatcher if slots else ContinuousBatcher)(backend, {95}, 3, 4096, max_prefill_tokens=16)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        batcher.add("a", prompts["a"], params)
        batcher.step()  # a's prompt in, its first token out
        batcher.add("b", prompts["b"], params)
        early, calls = [], []
        decode = batcher._decode_rows if slots else batcher._decode

        def counted():
            calls.append(len(early))  # how many events were handed over before the decode call
            return decode()

        if slots:
            batcher._decode_rows = counted
        else:
            batcher._decode = counted
        rest = batcher.step(early.extend if with_early else None)
        return early, rest, calls

    early, rest, calls = run(True)
    assert [e.id for e in early] == ["b"] and calls == [1]  # b's first token, before anyone's decode call
    assert sorted(e.id for e in rest) == ["a", "b"]  # then a token for each decoding sequence
    plain_early, plain_rest, _ = run(False)
    assert plain_early == [] and [(e.id, e.token) for e in plain_rest] == [(e.id, e.token) for e in early + rest]


def test_a_server_gone_while_first_tokens_are_sent_ends_the_worker_loop_quietly(tiny, caplog):
    from trtserve.server.generation_worker import generation_loop
    from trtserve.server.messages import AddSequences, NewSequence

    class Pipe:  # the worker's end of a server that asks for one sequence and is gone before its first token
        def __init__(self):
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            self.messages = [AddSequences([NewSequence("a", [5, 6, 7], params)])]

        def poll(self, timeout=None):
            return bool(self.messages)

        def recv(self):
            return self.messages.pop(0)

        def send(self, message):
            raise BrokenPipeError("the server is gone")

    batcher = SlotBatcher(OrtBackend(tiny, threads=1), {95}, 2, 4096, max_prefill_tokens=16)
    generation_loop(Pipe(), None, 2, 4096, 16, batcher=batcher)  # returns: no step failure, no new batcher
    assert "generation step failed" not in caplog.text
