"""Generation with the real SmolLM2 engine: the continuous batcher against plain greedy decoding,
and the real server against Hugging Face's own `generate`, with the official openai client."""

import asyncio
import concurrent.futures
import time

import httpx
import numpy as np
import pytest

from tests.conftest import require_package
from trtserve.testing.server import metric, start_server, stop_server

pytestmark = pytest.mark.models
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "In 1492, Christopher Columbus", "The largest planet in the solar system is"]


@pytest.fixture(scope="module")
def smollm2(engines):
    return engines["smollm2"]


@pytest.fixture(scope="module")
def server(smollm2):
    proc, url = start_server(smollm2, "--max-num-seqs", "8", "--max-n", "4")
    yield url
    stop_server(proc)


@pytest.fixture()
def client(server):
    require_package("openai", "pip install openai")
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def batcher_of(kind: str, backend, *args, **kwargs):
    """The padded batcher (the portable graph's contract, as TensorRT runs it) or the slot batcher that the
    server runs on the ONNX Runtime decode graph."""
    from trtserve.runtime.batching import ContinuousBatcher
    from trtserve.runtime.slot_batching import SlotBatcher, make_batcher

    if kind == "padded":
        return ContinuousBatcher(backend, *args, **kwargs)
    batcher = make_batcher(backend, *args, **kwargs)
    assert isinstance(batcher, SlotBatcher), "the build wrote and checked a decode graph"
    return batcher


@pytest.mark.parametrize("kind", ["padded", "slots"])
def test_continuous_batching_matches_one_sequence_greedy_decoding(smollm2, kind):
    from trtserve.runtime import generate, load_backend
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.text import TextEngine

    backend = load_backend(smollm2)
    text = TextEngine(backend)
    prompts = {p: text.tokenize([p], add_special_tokens=False)[0] for p in PROMPTS}
    alone = {}
    for p, ids in prompts.items():
        tokens, _ = generate.greedy(backend, np.array([ids]), np.ones((1, len(ids)), np.int64), 12)
        alone[p] = tokens[0].tolist()
    batcher = batcher_of(kind, backend, text.eos_ids, max_num_seqs=3, max_batched_tokens=64)
    got = {p: [] for p in PROMPTS}
    joins = {0: PROMPTS[:1], 2: PROMPTS[1:2], 3: PROMPTS[2:]}  # newcomers join a running batch
    step = 0
    while step < 3 or batcher.has_work():
        for p in joins.get(step, []):
            batcher.add(p, prompts[p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        if step == 5:
            assert batcher.running == 3 and len(batcher.waiting) == 1  # --max-num-seqs holds the fourth back
        for event in batcher.step():
            got[event.id].append(event.token)
        step += 1
    assert got == alone
    batcher.add("gone", prompts[PROMPTS[0]], SamplingParams(max_tokens=50, temperature=0))
    batcher.add("kept", prompts[PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    first = [e.token for e in batcher.step() if e.id == "kept"]  # prefill gives token 1, the decode step token 2
    assert batcher.cancel("gone") and batcher.running == 1  # its cache rows are cut out
    kept = first + [e.token for e in batcher.step() + batcher.step() + batcher.step()]
    assert kept == alone[PROMPTS[1]][:4] and not batcher.has_work()


@pytest.mark.parametrize("kind", ["padded", "slots"])
def test_chunked_prefill_gives_what_one_prefill_call_gives_and_keeps_streams_moving(smollm2, kind):
    from trtserve.runtime import load_backend
    from trtserve.runtime.sampling import SamplingParams
    from trtserve.runtime.text import TextEngine

    backend = load_backend(smollm2)
    text = TextEngine(backend)
    prompts = {p: text.tokenize([p], add_special_tokens=False)[0] for p in PROMPTS}
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=2)

    def run(max_prefill_tokens):
        batcher = batcher_of(kind, backend, text.eos_ids, 4, 64, max_prefill_tokens=max_prefill_tokens)
        got, firsts, moving = {p: [] for p in PROMPTS}, {}, []
        joins = {0: PROMPTS[:1], 1: PROMPTS[1:3], 9: PROMPTS[3:]}
        step = 0
        while step < 10 or batcher.has_work():
            for p in joins.get(step, []):
                batcher.add(p, prompts[p], scored if p == PROMPTS[3] else greedy)
            running = {s.id for s in batcher.decoding()}
            events = batcher.step()
            if batcher.newcomers and running:  # a chunk was fed while these were running
                moving.append(running <= {e.id for e in events})
            for event in events:
                got[event.id].append(event.token)
                if event.prompt_logprobs is not None:
                    firsts[event.id] = event.prompt_logprobs
            step += 1
        return got, firsts, moving

    whole, whole_scored, _ = run(None)
    chunked, chunked_scored, moving = run(3)  # 3 tokens a step: one column at a time for the pair
    assert chunked == whole
    assert moving and all(moving), "every running stream gets a token in every step of a chunked prefill"
    (a,), (b,) = whole_scored.values(), chunked_scored.values()
    assert [t for t, _, _ in a] == [t for t, _, _ in b] and a[0][1] is None
    np.testing.assert_allclose([lp for _, lp, _ in a[1:]], [lp for _, lp, _ in b[1:]], atol=1e-3)

    batcher = batcher_of(kind, backend, text.eos_ids, 4, 64, max_prefill_tokens=2)
    batcher.add("gone", prompts[PROMPTS[0]], greedy)
    batcher.add("kept", prompts[PROMPTS[1]], greedy)
    assert batcher.step() == [] and {s.id for s in batcher.newcomers} == {"gone", "kept"}  # one column of two rows
    assert batcher.cancel("gone") and [s.id for s in batcher.newcomers] == ["kept"]
    kept = []
    while batcher.has_work():
        kept += [e.token for e in batcher.step()]
    assert kept == whole[PROMPTS[1]]


def test_server_greedy_equals_hugging_face_generate(client, smollm2):
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve

    source = resolve(MODEL)
    model = load_torch_model(source, attention="eager")
    tokenizer = load_hf_tokenizer(source.path)
    for prompt in PROMPTS[:3]:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**ids, max_new_tokens=20, do_sample=False)
        expected = out[0, ids["input_ids"].shape[1]:].tolist()
        if tokenizer.eos_token_id in expected:
            expected = expected[: expected.index(tokenizer.eos_token_id)]
        served = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=0)
        assert served.choices[0].text == tokenizer.decode(expected)
        assert len(served.choices[0].logprobs.tokens) == len(expected) == served.usage.completion_tokens


def test_chat_answers_paris_and_streaming_agrees(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert "Paris" in whole.choices[0].message.content and whole.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_stream_stop_strings_n_and_seeds(client):
    kwargs = dict(model=MODEL, prompt="Here is a list of fruits:\n1.", max_tokens=30, temperature=0, stop=["\n3."])
    whole = client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    assert streamed == whole.choices[0].text and "\n3." not in streamed and whole.choices[0].finish_reason == "stop"
    sampled = dict(model=MODEL, prompt=["Once upon a time", "The sky is"], max_tokens=12, temperature=0.9,
                   seed=11, n=2)
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    echoed = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("The sky is")


def test_concurrent_requests_each_get_their_own_answer(client):
    def one(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    alone = {p: one(p) for p in PROMPTS}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, PROMPTS * 2))
    assert together == [alone[p] for p in PROMPTS * 2]


@pytest.mark.parametrize(("path", "body", "message"), [
    ("chat/completions", {"messages": []}, "`messages` is empty"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "'wizard'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 5}, "at most 4"),
    ("completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 5000}, "context of 2048 tokens"),
    ("completions", {"prompt": "hi", "temperature": 3}, "temperature"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "word " * 2100}, "over this engine's context"),
    ("completions", {"prompt": ""}, "no tokens"),
    ("completions", {"prompt": "hi", "logit_bias": {"49152": 5}}, "logit_bias keys are token ids in [0, 49152)"),
    ("completions", {"prompt": "hi", "logit_bias": {"-3": 5}}, "'-3' is not one"),
    ("completions", {"prompt": "hi", "stop_token_ids": [2, 10**6]}, "stop_token_ids must be token ids"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens (5) is over max_tokens (4)"),
    ("completions", {"prompt": "hi", "best_of": 3}, "`best_of` is not applied by this server"),
    ("completions", {"prompt": "hi", "allowed_token_ids": [10**7]}, "allowed_token_ids must be token ids"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "x"}},
     "`audio` is not applied"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": []}},
     "chat_template_kwargs.tools is set by the request itself"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True,
                          "add_generation_prompt": True}, "cannot both be true"),
    ("embeddings", {"input": "hi"}, "decoder engine"),
])
def test_bad_generation_requests_are_openai_shaped_400s(server, path, body, message):
    response = httpx.post(f"{server}/v1/{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and message in error["message"]


def test_no_chat_template_is_a_clear_400_and_completions_still_work(smollm2):
    from trtserve.server.config import ServerConfig
    from trtserve.server.errors import BadRequest
    from trtserve.server.generation import GenerationService
    from trtserve.server.protocol import ChatCompletionRequest, CompletionRequest

    service = GenerationService(ServerConfig(engine_dir=str(smollm2)))
    service.chat = None  # as for a tokenizer config without a chat template
    with pytest.raises(BadRequest, match="no chat template"):
        asyncio.run(service.chat_jobs(ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}])))
    assert asyncio.run(service.completion_jobs(CompletionRequest(model=MODEL, prompt="hi")))[0].prompt


def test_client_that_disconnects_mid_stream_frees_its_sequence(server):
    # 1900 tokens take well over 20 s here: only a cancelled sequence leaves the batch in time
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    deadline = time.time() + 10
    while metric(server, "trtserve_running_sequences") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "trtserve_running_sequences") == 0  # as the worker reports its batch
    assert metric(server, "trtserve_time_to_first_token_seconds_count") > 0
    assert httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_worker_killed_mid_stream_ends_the_stream_with_an_error_event_and_recovers(smollm2):
    import json
    import os
    import signal

    proc, url = start_server(smollm2)
    try:
        victim = httpx.get(f"{url}/health").json()["workers"][0]["pid"]
        body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        os.kill(victim, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "stopped while generating" in error["message"] and error["type"] == "service_unavailable"
        deadline = time.time() + 120

        def restarted():
            health = httpx.get(f"{url}/health")
            return health.status_code == 200 and health.json()["workers"][0]["pid"] != victim

        while not restarted() and time.time() < deadline:
            time.sleep(0.3)
        again = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert again.status_code == 200 and restarted()
    finally:
        stop_server(proc)


def test_prefill_of_the_last_position_equals_that_row_of_every_position(smollm2):
    from trtserve.runtime import generate, load_backend
    from trtserve.runtime.text import TextEngine

    backend = load_backend(smollm2)
    text = TextEngine(backend)
    ids = np.array(text.tokenize(["The capital of France is Paris, and the capital of Italy is"],
                                 add_special_tokens=False), np.int64)
    every = generate.step(backend, generate.start(backend, 1), ids)
    last = generate.step(backend, generate.start(backend, 1), ids, last_only=True)
    assert every.shape[1] == ids.shape[1] and last.shape[1] == 1
    np.testing.assert_allclose(last[0, 0], every[0, -1], atol=1e-4)


def test_echo_with_logprobs_scores_the_prompt_as_hugging_face_does(client):
    import torch

    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve

    prompt = "The capital of France is Paris."
    source = resolve(MODEL)
    tokenizer = load_hf_tokenizer(source.path)
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = load_torch_model(source, attention="eager")(input_ids=ids).logits[0]
    expected = torch.log_softmax(logits[:-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0].numpy()
    # lm-evaluation-harness's loglikelihood request (its local-completions backend)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    lp = whole.choices[0].logprobs
    assert whole.choices[0].text.startswith(prompt) and len(lp.tokens) == ids.shape[1] + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    np.testing.assert_allclose(lp.token_logprobs[1:ids.shape[1]], expected, atol=2e-3)
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.tokens == lp.tokens[:ids.shape[1]]


def test_a_stop_string_found_by_the_server_cancels_the_sequence_in_the_worker(server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True,
            "stop": [" "], "temperature": 0}  # a space comes within a few tokens; 1500 tokens take > 30 s
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "stop"
    deadline = time.time() + 10
    while metric(server, "trtserve_running_sequences") > 0 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, "trtserve_running_sequences") == 0  # not decoding on to max_tokens


def _stepped(model, ids: list[int], steps: int, rule=None, stops=frozenset()) -> list[int]:
    """Greedy tokens of transformers' model stepped by hand (its KV cache carried), each row of logits passed
    through rule(row, generated) first; a token in `stops` ends it, unemitted."""
    import torch

    out, past, feed = [], None, torch.tensor([ids])
    with torch.inference_mode():
        for _ in range(steps):
            result = model(input_ids=feed, past_key_values=past, use_cache=True)
            past, row = result.past_key_values, result.logits[0, -1].double().numpy()
            token = int(np.argmax(rule(row.copy(), out) if rule else row))
            if token in stops:
                break
            out.append(token)
            feed = torch.tensor([[token]])
    return out


def test_sampling_parameters_apply_the_rules_transformers_gives_when_stepped_by_hand(client, smollm2):
    """logit_bias, repetition_penalty, stop_token_ids and min_tokens through the real server (streamed and
    not), each against the same rule applied to transformers' logits; min_p 1 samples the greedy tokens."""
    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve
    from trtserve.runtime.text import SpecialTokens, load_tokenizer

    source = resolve(MODEL)
    model = load_torch_model(source, attention="eager")
    tokenizer = load_hf_tokenizer(source.path)
    eos = set(SpecialTokens.of(smollm2, load_tokenizer(smollm2)).eos_ids)
    prompt = PROMPTS[1]
    ids = tokenizer(prompt)["input_ids"]
    plain = _stepped(model, ids, 12, stops=eos)

    def bias(row, generated):
        row[plain[0]] -= 100
        row[plain[3]] += 4
        return row

    def penalty(row, generated):
        seen = sorted(set(ids) | set(generated))
        row[seen] = np.where(row[seen] > 0, row[seen] / 1.3, row[seen] * 1.3)
        return row

    cases = [({"logit_bias": {str(plain[0]): -100, str(plain[3]): 4}}, bias, eos),
             ({"repetition_penalty": 1.3}, penalty, eos),
             ({"stop_token_ids": [plain[4]]}, None, eos | {plain[4]})]
    for body, rule, stops in cases:
        expected = _stepped(model, ids, 12, rule, stops)
        for stream in (False, True):
            got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=stream,
                                            extra_body=body)
            text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
            assert text == tokenizer.decode(expected), (body, stream)
    # a one-word chat answer ends at once; min_tokens holds its end tokens back
    asked = "<|im_start|>user\nName the capital of France, one word only.<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tokenizer(asked)["input_ids"]
    short = _stepped(model, chat_ids, 12, stops=eos)
    held = _stepped(model, chat_ids, 12, lambda row, generated: _held(row, generated, eos, 8), eos)
    assert len(short) < 8 <= len(held)
    got = client.completions.create(model=MODEL, prompt=asked, max_tokens=12, temperature=0,
                                    extra_body={"min_tokens": 8})
    assert got.choices[0].text == tokenizer.decode(held) and got.usage.completion_tokens == len(held)
    sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0, seed=3,
                                        extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == tokenizer.decode(plain)


def _held(row, generated, ends, count):
    if len(generated) < count:
        row[sorted(ends)] = -np.inf
    return row


def test_the_checkpoints_chat_template_renders_as_transformers_apply_chat_template(smollm2):
    """SmolLM2's own template through the server's renderer and through transformers' tokenizer: with and without
    the generation prompt, a continued final message, tools and template kwargs."""
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.models.sources import resolve
    from trtserve.runtime.text import SpecialTokens, load_tokenizer
    from trtserve.server.chat import ChatRenderer

    tokenizer = load_hf_tokenizer(resolve(MODEL).path)
    renderer = ChatRenderer.for_engine(smollm2, SpecialTokens.of(smollm2, load_tokenizer(smollm2)))
    messages = [{"role": "system", "content": "Tu es bref."}, {"role": "user", "content": "2 < 3 ?"},
                {"role": "assistant", "content": "Oui, car"}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                   {"continue_final_message": True}, {"add_generation_prompt": True, "tools": tools},
                   {"add_generation_prompt": True, "chat_template_kwargs": {"custom": 1}}):
        extra = kwargs.get("chat_template_kwargs", {})
        expected = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=kwargs.get("add_generation_prompt", False),
            continue_final_message=kwargs.get("continue_final_message", False), tools=kwargs.get("tools"), **extra)
        got = renderer.render(messages, kwargs.get("add_generation_prompt", False), kwargs.get("tools"),
                              kwargs.get("continue_final_message", False), extra or None)
        assert got == expected, kwargs


def test_continue_final_message_extends_the_assistants_words_and_model_may_be_left_out(server):
    """The prompt ends inside the assistant's unfinished message (no end-of-turn, no new turn), so the answer
    continues it; `model` left out names the one model served."""
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "The capital of France is"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 6, "temperature": 0}
    answer = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == MODEL and "Paris" in answer.json()["choices"][0]["message"]["content"]
    rendered = httpx.post(f"{server}/tokenize", json={k: body[k] for k in ("messages", "continue_final_message",
                                                                           "add_generation_prompt")}, timeout=60)
    assert rendered.status_code == 200, rendered.text
    tokens = rendered.json()["tokens"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")
