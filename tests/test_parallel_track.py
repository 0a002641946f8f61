"""Parallel-track model: its semantics, its KV cache, the dense special case against Hugging Face's
Llama, and sharded execution (PT and tensor-parallel) against the single-process reference."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from trtserve.errors import ModelSourceError, TrtServeError
from trtserve.models.parallel_track import PTConfig
from trtserve.models.pt_model import ParallelTrackModel, block, load_checkpoint, save_checkpoint

SMALL = dict(vocab_size=300, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=128,
             num_layers=4, n_tracks=4, block_depth=2)


def model(**changes) -> ParallelTrackModel:
    torch.manual_seed(0)
    return ParallelTrackModel(PTConfig(**{**SMALL, **changes})).eval()


def test_config_refuses_shapes_that_do_not_split():
    with pytest.raises(ModelSourceError, match=r"num_heads \(6\) is not divisible by n_tracks \(4\)"):
        PTConfig(**{**SMALL, "num_heads": 6})
    with pytest.raises(ModelSourceError, match=r"num_layers \(4\) is not a multiple of block_depth \(3\)"):
        PTConfig(**{**SMALL, "block_depth": 3})


def test_tracks_run_alone_for_d_layers_then_add_their_updates():
    """The stacked implementation against a loop written out track by track."""
    m = model()
    cfg = m.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    with torch.no_grad():
        got, _ = m(ids)
        h = m.embed(ids)
        for segment in range(cfg.segments):
            updates = []
            for track in range(cfg.n_tracks):
                x = h[None]
                for layer in range(segment * cfg.block_depth, (segment + 1) * cfg.block_depth):
                    x, _ = block(m.layers[layer].params(slice(track, track + 1)), x, cfg, 1, 1)
                updates.append(x[0] - h)
            h = h + sum(updates)
        expected = m.head(h)
    assert torch.allclose(got, expected, atol=1e-5)
    assert m.syncs == cfg.segments  # one all-reduce per segment: L/D


def test_kv_cache_continues_exactly():
    m = model()
    ids = torch.randint(0, 300, (2, 12))
    with torch.no_grad():
        full, _ = m(ids)
        first, past = m(ids[:, :6])
        second, past = m(ids[:, 6:9], past)  # a chunk after the cache
        steps = [first, second]
        for t in range(9, 12):
            out, past = m(ids[:, t:t + 1], past)
            steps.append(out)
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


def test_one_track_depth_one_is_hugging_face_llama():
    transformers = pytest.importorskip("transformers", reason="needs transformers: pip install 'trtserve[export]'")
    m = model(n_tracks=1, block_depth=1, num_kv_heads=2)
    cfg = m.cfg
    hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                                      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                                      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                                      head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                                      tie_word_embeddings=True, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {"model.embed_tokens.weight": m.embed.weight, "model.norm.weight": m.norm.weight,
             "lm_head.weight": m.embed.weight}
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "q_proj": "self_attn.q_proj",
             "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
             "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj"}
    for i, layer in enumerate(m.layers):
        for ours, theirs in names.items():
            state[f"model.layers.{i}.{theirs}.weight"] = getattr(layer, ours)[0]
    hf.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        ours, _ = m(ids)
        theirs = hf(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_checkpoint_round_trip(tmp_path):
    m = model()
    save_checkpoint(m, tmp_path / "pt", tmp_path)
    loaded = load_checkpoint(tmp_path / "pt")
    ids = torch.randint(0, 300, (1, 5))
    with torch.no_grad():
        assert torch.equal(m(ids)[0], loaded(ids)[0])
    with pytest.raises(ModelSourceError, match="is not a parallel-track checkpoint"):
        load_checkpoint(tmp_path)


def reference_steps(checkpoint, prompt: np.ndarray, steps: int):
    """Logits of the last position after the prompt and after each greedy token, and those tokens."""
    m = load_checkpoint(checkpoint)
    with torch.no_grad():
        logits, past = m(torch.as_tensor(prompt))
        outs, tokens = [logits[:, -1].numpy()], []
        for _ in range(steps):
            token = outs[-1].argmax(-1)[:, None]
            tokens.append(token)
            logits, past = m(torch.as_tensor(token), past)
            outs.append(logits[:, -1].numpy())
    return outs, tokens


def sharded_steps(checkpoint, mode: str, world: int, prompt: np.ndarray, tokens):
    from trtserve.engine_dir import MANIFEST
    from trtserve.research.torch_shards import torch_decoder
    from trtserve.runtime.sharded import ShardedDecoder

    engine = (Path(checkpoint) / MANIFEST).is_file()  # a track-sharded engine dir, else a torch checkpoint
    with ShardedDecoder(checkpoint, world) if engine else torch_decoder(checkpoint, world, mode) as decoder:
        steps = [decoder.prefill(prompt)] + [decoder.decode(t) for t in tokens]
    return steps


def test_sharded_random_model_matches_with_two_workers(tmp_path):
    save_checkpoint(model(), tmp_path / "pt", tmp_path)
    prompt = np.random.default_rng(0).integers(0, 300, (2, 8))
    expected, tokens = reference_steps(tmp_path / "pt", prompt, 4)
    steps = sharded_steps(tmp_path / "pt", "pt", 2, prompt, tokens)
    assert max(np.abs(s.logits - e).max() for s, e in zip(steps, expected)) <= 1e-4
    assert {s.syncs for s in steps} == {2}  # L/D = 4/2


def test_sharding_that_does_not_divide_is_a_clear_error(tmp_path):
    from trtserve.research.torch_shards import torch_decoder

    save_checkpoint(model(), tmp_path / "pt", tmp_path)
    with pytest.raises(TrtServeError, match="4 tracks cannot be split over 3 workers"):
        torch_decoder(tmp_path / "pt", 3, "pt")
    with pytest.raises(TrtServeError, match="tensor parallelism here splits a dense model"):
        torch_decoder(tmp_path / "pt", 2, "tp")


@pytest.fixture(scope="module")
def trained():
    """The `tiny` recipe's PT and dense checkpoints, trained on Wikipedia once and cached."""
    from trtserve.research.pt_train import checkpoint

    return {"pt": checkpoint("tiny", "pt"), "tp": checkpoint("tiny", "dense")}


@pytest.mark.models
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("mode", ["pt", "tp"])
def test_sharded_trained_model_equals_reference_for_prefill_and_32_steps(trained, mode, world):
    from tokenizers import Tokenizer

    from trtserve.data.corpus import wiki_paragraphs
    from trtserve.research.pt_train import to_compact

    path = trained[mode]
    m = load_checkpoint(path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = [tok.encode(p, add_special_tokens=False).ids[:24] for p in wiki_paragraphs()[-2:]]
    prompt = torch.stack([to_compact(row, m.vocab) for row in text]).numpy()
    expected, tokens = reference_steps(path, prompt, 32)
    steps = sharded_steps(path, mode, world, prompt, tokens)
    assert len(steps) == 33
    assert max(np.abs(s.logits - e).max() for s, e in zip(steps, expected)) <= 1e-4
    cfg = m.cfg
    want = cfg.num_layers // cfg.block_depth if mode == "pt" else 2 * cfg.num_layers
    assert {s.syncs for s in steps} == {want}  # PT: L/D = 2; TP: 2L = 16


@pytest.mark.models
def test_trained_models_learned_wikipedia(trained):
    from trtserve.research.pt_train import results

    for path in trained.values():
        r = results(path)
        assert r["heldout_perplexity"] < 0.5 * r["recipe"]["vocab"], r  # far better than guessing uniformly
        assert r["final_train_loss"] < 7.0, r


@pytest.fixture(scope="module")
def track_engine(trained, tmp_path_factory):
    """The tiny PT checkpoint built into a track-sharded engine dir through the CLI."""
    from tests.conftest import run_cli

    out = tmp_path_factory.mktemp("tracks") / "engine"
    result = run_cli("build-engine", str(trained["pt"]), "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "4 tracks x 2 segments, 2 all-reduce(s) per forward" in result.stdout
    info = run_cli("info", str(out))
    assert info.returncode == 0 and "4 tracks x 2 segments of 4 layers" in info.stdout, info.stdout + info.stderr
    return out


@pytest.mark.models
@pytest.mark.parametrize("world", [2, 4])
def test_track_engines_sharded_equal_reference(trained, track_engine, world):
    from trtserve.engine_dir import open_engine_dir

    manifest = open_engine_dir(track_engine).manifest
    assert manifest.parity.max_abs_error <= 1e-4
    assert manifest.parallel_tracks.sync.per_forward == 2
    prompt = np.random.default_rng(3).integers(1, 4097, (2, 12))
    expected, tokens = reference_steps(trained["pt"], prompt, 32)
    steps = sharded_steps(track_engine, "pt", world, prompt, tokens)
    assert max(np.abs(s.logits - e).max() for s, e in zip(steps, expected)) <= 1e-4
    assert {s.syncs for s in steps} == {2}


@pytest.mark.models
def test_serve_rejects_a_wrong_tracks_option_before_starting(track_engine, minilm_engine):
    from tests.conftest import run_cli

    uneven = run_cli("serve", str(track_engine), "--tracks", "3", timeout=120)
    assert uneven.returncode == 2 and "Traceback" not in uneven.stderr, uneven.stderr[-2000:]
    assert "4 tracks cannot be split over 3 workers: use a divisor of 4" in uneven.stderr
    dense = run_cli("serve", str(minilm_engine), "--tracks", "2", timeout=120)
    assert dense.returncode == 2 and "Traceback" not in dense.stderr, dense.stderr[-2000:]
    assert "is not one (its model kind is encoder): leave --tracks out" in dense.stderr
    several = run_cli("serve", str(track_engine), "--workers", "2", timeout=120)
    assert several.returncode == 2 and "--workers 2 cannot apply (use 1, or 0 for the server process)" in \
        several.stderr, several.stderr[-2000:]


@pytest.mark.models
def test_server_serves_a_track_sharded_engine_over_two_workers(trained, track_engine):
    from openai import OpenAI
    from tokenizers import Tokenizer

    from trtserve.research.pt_train import to_compact
    from trtserve.testing.server import start_server, stop_server

    proc, url = start_server(track_engine, "--tracks", "2")
    try:
        health = httpx_get(f"{url}/health")
        assert len(health["workers"]) == 2 and all(w["ready"] for w in health["workers"])
        api = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        model_id = api.models.list().data[0].id
        prompt = "The city is the capital of the"
        got = api.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0)
        # the same greedy continuation from the torch reference, all tracks in one process
        m = load_checkpoint(trained["pt"])
        tok = Tokenizer.from_file(str(trained["pt"] / "tokenizer.json"))
        ids = to_compact(tok.encode(prompt).ids, m.vocab)[None]
        out, past = [], None
        with torch.no_grad():
            for _ in range(8):
                logits, past = m(ids, past)
                row = logits[0, -1].clone()
                row[0] = -float("inf")
                ids = row.argmax().view(1, 1)
                if int(m.vocab[ids]) in (tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")):
                    break
                out.append(int(m.vocab[ids]))
        assert got.choices[0].text == tok.decode(out)
        assert got.usage.completion_tokens == len(out) > 0
        stream = api.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hello"}],
                                             max_tokens=6, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(pieces).strip()
        # the continuous batcher's grammars serve track engines too (single-token choices: the tiny model's
        # compact vocabulary lacks some pieces of longer words' other spellings, which a grammar allows)
        picked = api.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"structured_outputs": {"choice": ["1", "2"]}})
        assert picked.choices[0].text in ("1", "2") and picked.choices[0].finish_reason == "stop"
    finally:
        stop_server(proc)


def greedy_reference(m, tok, ids: list[int], steps: int) -> list[int]:
    """The torch model's greedy tokenizer ids after tokenizer ids `ids`, one sequence alone (unknown id never)."""
    from trtserve.research.pt_train import to_compact

    x, past, out = to_compact(ids, m.vocab)[None], None, []
    with torch.no_grad():
        for _ in range(steps):
            logits, past = m(x, past)
            row = logits[0, -1].clone()
            row[0] = -float("inf")
            x = row.argmax().view(1, 1)
            out.append(int(m.vocab[x]))
    return out


@pytest.mark.models
def test_the_slot_batcher_drives_track_ranks_like_any_backend(trained, track_engine):
    """Sequences of different lengths decode together over 2 ranks (equal-length rows share a call), with
    chunked prefill and the prefix cache: each gets the greedy tokens the torch model gives it alone."""
    from tokenizers import Tokenizer

    from trtserve.data.corpus import wiki_paragraphs
    from trtserve.runtime import load_backend
    from trtserve.runtime.prefix_cache import PrefixCache
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.sharded import RunSlots
    from trtserve.runtime.slot_batching import SlotBatcher, make_batcher

    tok = Tokenizer.from_file(str(trained["pt"] / "tokenizer.json"))
    text = tok.encode(" ".join(wiki_paragraphs()[:2])).ids
    prompts = [text[:20], text[40:60], text[80:87], text[:16] + text[100:117]]  # the last reuses 16 cached rows
    backend = load_backend(track_engine, ranks={"tracks": 2})
    try:
        assert backend.abilities.kv_slots and len(backend.processes) == 0  # ranks start with the first slots
        batcher = make_batcher(backend, set(), max_num_seqs=3, max_prefill_tokens=16)
        assert isinstance(batcher, SlotBatcher) and len(backend.processes) == 2
        batcher.prefix_cache = PrefixCache(64 << 20)
        shared, call = [], backend.decoder.call

        def counted(message):  # how many sequences each forward over the ranks carried
            shared.append(len(message.keys) if isinstance(message, RunSlots) else 0)
            return call(message)

        backend.decoder.call = counted
        for i, prompt in enumerate(prompts):  # one more than the slots: the last waits for a free one
            batcher.add(str(i), prompt, SamplingParams(max_tokens=8 + i, temperature=0, ignore_eos=True))
        got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        for _ in range(200):
            if not batcher.has_work():
                break
            for event in batcher.step():
                assert event.error is None, event.error
                got[event.id].append(event.token)
        m = load_checkpoint(trained["pt"])
        for i, prompt in enumerate(prompts):
            assert got[str(i)] == greedy_reference(m, tok, prompt, 8 + i), i
        assert batcher.prefix_cache.hits == 16
        assert max(shared) == 2  # the two 20-token prompts decode in one call
        again = make_batcher(backend, set(), max_num_seqs=3)  # a fresh batcher on the same ranks: no stale rows
        again.add("x", prompts[2], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        tokens = []
        while again.has_work():
            tokens += [e.token for e in again.step()]
        assert tokens == greedy_reference(m, tok, prompts[2], 8)
    finally:
        backend.close()


def httpx_get(url: str) -> dict:
    import httpx

    response = httpx.get(url, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.gpu
def test_sharded_pt_on_gpus_with_nccl_equals_reference(tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (NCCL all-reduce between GPU workers)")
    save_checkpoint(model(), tmp_path / "pt", tmp_path)
    prompt = np.random.default_rng(0).integers(0, 300, (2, 8))
    expected, tokens = reference_steps(tmp_path / "pt", prompt, 8)
    steps = sharded_steps(tmp_path / "pt", "pt", 2, prompt, tokens)
    assert max(np.abs(s.logits - e).max() for s, e in zip(steps, expected)) <= 1e-3  # TF32/cuBLAS tolerance


@pytest.mark.models
@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["sigstop", "sigkill"])
def test_a_stuck_or_dead_rank_ends_the_stream_within_the_deadline_and_the_ranks_restart(track_engine, fault):
    import json
    import time

    import httpx

    from trtserve.engine_dir import open_engine_dir
    from trtserve.testing.server import start_server, stop_server

    context = open_engine_dir(track_engine).manifest.model.architecture.max_positions
    proc, url = start_server(track_engine, "--tracks", "2", "--worker-timeout", "3")
    try:
        ranks = [w["pid"] for w in httpx_get(f"{url}/health")["workers"]]
        model_id = httpx_get(f"{url}/v1/models")["data"][0]["id"]
        body = {"model": model_id, "prompt": "The city", "max_tokens": context - 8, "ignore_eos": True,
                "stream": True, "temperature": 0}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        os.kill(ranks[1], fault)
                        hit = time.monotonic()
        assert time.monotonic() - hit < 3 + 10
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "service_unavailable"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            health = httpx.get(f"{url}/health", timeout=5)
            if health.status_code == 200 and ranks[1] not in [w["pid"] for w in health.json()["workers"]]:
                break
            time.sleep(0.3)
        assert health.status_code == 200 and health.json()["workers"][0]["restarts"] == 1
        again = httpx.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
        with pytest.raises(ProcessLookupError):
            os.kill(ranks[1], 0)
    finally:
        stop_server(proc)
