"""Sampling rules, stop-string hold-back and chat-template rendering (no model needed)."""

import numpy as np
import pytest

from trtserve.runtime.sampling import Sampler, SamplingParams, log_softmax
from trtserve.server.chat import ChatRenderer
from trtserve.server.errors import BadRequest
from trtserve.server.generation import _first_stop, _safe_end

LOGITS = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))


def draw(params: SamplingParams, n: int = 4000) -> np.ndarray:
    sampler = Sampler(params, vocab=4)
    return np.bincount([sampler.choose(LOGITS)[0] for _ in range(n)], minlength=4) / n


def test_greedy_and_top_k_1_take_the_argmax():
    assert Sampler(SamplingParams(temperature=0), 4).choose(LOGITS)[0] == 0
    assert Sampler(SamplingParams(temperature=1.5, top_k=1), 4).choose(LOGITS)[0] == 0


def test_temperature_1_samples_the_model_distribution():
    assert np.allclose(draw(SamplingParams(seed=0)), [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_top_k_and_top_p_cut_the_tail():
    assert draw(SamplingParams(seed=1, top_k=2))[2:].sum() == 0
    freq = draw(SamplingParams(seed=2, top_p=0.75))  # 0.5 + 0.3 reaches 0.75: two tokens stay
    assert freq[2:].sum() == 0 and np.allclose(freq[:2], [0.5 / 0.8, 0.3 / 0.8], atol=0.03)


@pytest.mark.parametrize("vocab", [64, 600])  # within one block of the whole-vocabulary draw, and over three
def test_a_wide_vocabulary_is_sampled_as_its_softmax_whole_or_cut_by_top_k_or_min_p(vocab):
    rng = np.random.default_rng(5)
    logits = rng.standard_normal(vocab).astype(np.float32) * 2
    logits[:4] += 3  # a few likely tokens
    logits[[3, 40, 255, 256][: 2 if vocab < 256 else 4]] = -np.inf  # masked tokens (a grammar) are never drawn
    want = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    top = np.argsort(-want)[:5]
    likely = want >= 0.05 * want.max()
    for params, kept in ((SamplingParams(seed=6), want > 0),  # no cut: drawn without sorting the vocabulary
                         (SamplingParams(seed=7, top_k=5), np.isin(np.arange(vocab), top)),  # the five likeliest
                         (SamplingParams(seed=8, min_p=0.05), likely)):  # at least 5% of the likeliest's
        sampler = Sampler(params, vocab)
        freq = np.bincount([sampler.choose(logits)[0] for _ in range(20000)], minlength=vocab) / 20000
        expected = np.where(kept, want, 0) / want[kept].sum()
        assert freq[want == 0].sum() == 0 and np.abs(freq - expected).max() < 0.015, (params, freq, expected)


def _nucleus(logits: np.ndarray, top_p: float) -> np.ndarray:
    """softmax, cut to the smallest prefix by falling probability with mass >= top_p, renormalised."""
    probs = np.exp(logits - logits.max()).astype(np.float64)
    probs /= probs.sum()
    order = np.argsort(-probs)
    keep = int(np.searchsorted(np.cumsum(probs[order]), top_p) + 1)
    out = np.zeros_like(probs)
    out[order[:keep]] = probs[order[:keep]] / probs[order[:keep]].sum()
    return out


@pytest.mark.parametrize("spread", [4.0, 0.01])  # a nucleus among the likeliest 256, and one wider than them
def test_top_p_over_a_wide_vocabulary_draws_from_the_nucleus(spread):
    rng = np.random.default_rng(9)
    logits = (rng.standard_normal(1000) * spread).astype(np.float32)
    logits[:5] += 8 * (spread > 1)  # a few likely tokens, as a model's logits have
    sampler = Sampler(SamplingParams(seed=10, top_p=0.9), 1000)
    n = 20000
    freq = np.bincount([sampler.choose(logits)[0] for _ in range(n)], minlength=1000) / n
    want = _nucleus(logits, 0.9)
    assert freq[want == 0].sum() == 0 and np.abs(freq - want).max() < 0.015


def test_same_seed_same_tokens_other_seed_other_tokens():
    def run(seed):
        sampler = Sampler(SamplingParams(seed=seed, temperature=1.0), 4)
        return [sampler.choose(LOGITS)[0] for _ in range(50)]

    assert run(7) == run(7) and run(7) != run(8)


def test_penalties_follow_openai_formula():
    sampler = Sampler(SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5, logprobs=1), 4)
    first, _, _ = sampler.choose(LOGITS)
    assert first == 0
    # token 0 now has count 1: its logit drops by 1.0 + 0.5 = 1.5 (log 0.5 - 1.5 < log 0.3)
    second, logprob, top = sampler.choose(LOGITS)
    assert second == 1
    penalised = LOGITS.copy()
    penalised[0] -= 1.5
    assert logprob == pytest.approx(float(log_softmax(penalised)[1]), abs=1e-6) and top[0][0] == 1


def test_logprobs_of_the_chosen_token_and_the_top_k():
    token, logprob, top = Sampler(SamplingParams(temperature=0, logprobs=3), 4).choose(LOGITS)
    assert token == 0 and logprob == pytest.approx(np.log(0.5), abs=1e-6)
    assert [t for t, _ in top] == [0, 1, 2]


def test_stop_strings_are_found_across_pieces_and_held_back():
    assert _first_stop("Paris.\nThe", ["\n"], 0) == 6
    assert _first_stop("abc END", ["END", "c E"], 3) == 2
    assert _safe_end("Hello wor", ["world!"]) == len("Hello ")  # "wor" may become "world!"
    assert _safe_end("Hello\ufffd", []) == 5  # half a character waits for its other bytes
    assert _safe_end("Hello", ["xyz"]) == 5


def test_chat_template_renders_roles_and_refuses_bad_messages():
    renderer = ChatRenderer("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}{{ eos_token }}", eos_token="</s>")
    text = renderer.render([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<system>Be brief.\n<user>Hi\n<assistant></s>"
    with pytest.raises(BadRequest, match="empty"):
        renderer.render([])
    with pytest.raises(BadRequest, match="'wizard'"):
        renderer.render([{"role": "wizard", "content": "x"}])
    strict = ChatRenderer("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(BadRequest, match="roles must alternate"):
        strict.render([{"role": "user", "content": "x"}])


def test_any_64_bit_seed_and_a_tiny_temperature_sample_without_raising():
    for seed in (-1, -(2**63), 2**63 - 1, 0):
        Sampler(SamplingParams(seed=seed, temperature=1.0), 4).choose(LOGITS)
    assert Sampler(SamplingParams(temperature=1e-30), 4).choose(LOGITS)[0] == 0  # below 1e-5: greedy
    assert Sampler(SamplingParams(temperature=1e-5, seed=3), 4).choose(LOGITS)[0] == 0


def test_logits_that_are_not_numbers_raise_a_sampling_error_masked_tokens_do_not():
    from trtserve.runtime.sampling import SamplingError

    for bad in (np.array([0.1, np.nan, 0.2, 0.3]), np.array([0.1, np.inf, 0.2, 0.3]), np.full(4, -np.inf)):
        with pytest.raises(SamplingError, match="not finite"):
            Sampler(SamplingParams(temperature=0.7, seed=0), 4).choose(bad.astype(np.float32))
    masked = np.array([-np.inf, 0.0, -np.inf, -np.inf], dtype=np.float32)
    assert Sampler(SamplingParams(temperature=0.7, seed=0, logprobs=2), 4).choose(masked)[0] == 1


def test_penalties_count_tokens_only_when_asked():
    plain = Sampler(SamplingParams(temperature=0), 49152)
    plain.choose(np.zeros(49152, dtype=np.float32))
    assert plain.counts is None  # no vocabulary-sized array per waiting sequence
    penalised = Sampler(SamplingParams(temperature=0, frequency_penalty=2.0), 4)
    assert [penalised.choose(LOGITS)[0] for _ in range(2)] == [0, 1]


def test_prompt_logprobs_score_each_token_by_the_position_before_it():
    from trtserve.runtime.sampling import prompt_logprobs

    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]], dtype=np.float32))
    rows = prompt_logprobs([2, 0, 2], logits, top=1)
    assert rows[0] == (2, None, None)  # the first token has nothing before it
    assert rows[1][0] == 0 and np.isclose(rows[1][1], np.log(0.5)) and rows[1][2][0][0] == 0
    assert rows[2][0] == 2 and np.isclose(rows[2][1], np.log(0.8)) and rows[2][2] == [(2, rows[2][1])]


def test_one_finish_rule_for_every_decode_loop():
    from trtserve.runtime.sampling import finish_reason

    params = SamplingParams(max_tokens=3)
    assert finish_reason(2, params, {2}, 1, 10, 100) == "stop"  # end of sequence
    assert finish_reason(2, SamplingParams(max_tokens=3, ignore_eos=True), {2}, 1, 10, 100) is None
    assert finish_reason(5, params, {2}, 2, 10, 100) is None
    assert finish_reason(5, params, {2}, 3, 10, 100) == "length"  # max_tokens reached with this token
    assert finish_reason(5, params, {2}, 1, 100, 100) == "length"  # the context is full


def test_special_tokens_are_read_one_way_from_the_engine_files(tmp_path):
    import json

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from trtserve.runtime.text import SpecialTokens

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|im_end|>": 3, "hello": 4}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2], "pad_token_id": 4}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "<|im_end|>"}))
    special = SpecialTokens.of(tmp_path, tokenizer)
    assert special == SpecialTokens(frozenset({2, 3}), 4, "<s>", "<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))  # overrides config.json's
    assert SpecialTokens.of(tmp_path, tokenizer).eos_ids == {1, 3}


class _OnlyTwo:
    """A grammar that allows tokens 3 and 5 only (the interface runtime/constraints.Constraint has)."""

    def __init__(self):
        self.consumed = []

    def apply(self, logits):
        keep = logits[[3, 5]].copy()
        logits[:] = -np.inf
        logits[[3, 5]] = keep

    def consume(self, token):
        self.consumed.append(token)


def test_a_constraint_masks_the_choice_and_its_logprobs_stay_finite():
    grammar = _OnlyTwo()
    sampler = Sampler(SamplingParams(temperature=0, logprobs=5), 8, grammar)
    token, logprob, top = sampler.choose(np.arange(8, dtype=np.float32))
    assert token == 5 and grammar.consumed == [5] and np.isfinite(logprob)
    assert [t for t, _ in top] == [5, 3] and all(np.isfinite(v) for _, v in top)  # ruled-out tokens are not listed


def test_logit_bias_min_tokens_repetition_penalty_and_min_p_follow_their_rules():
    """OpenAI's logit_bias, and vLLM's min_tokens, repetition_penalty (Hugging Face's formula) and min_p."""
    greedy = dict(temperature=0)
    # a bias of -100 rules the argmax out, +100 makes a token the choice
    assert Sampler(SamplingParams(**greedy, logit_bias=((0, -100.0),)), 4).choose(LOGITS)[0] == 1
    assert Sampler(SamplingParams(**greedy, logit_bias=((3, 100.0),)), 4).choose(LOGITS)[0] == 3
    # end tokens (end-of-sequence and stop_token_ids) cannot come before min_tokens, then can
    held = Sampler(SamplingParams(**greedy, min_tokens=2, stop_token_ids=(1,)), 4, eos_ids={0})
    assert [held.choose(LOGITS)[0] for _ in range(3)] == [2, 2, 0]
    # a seen token's logit l becomes l / p where l > 0, l * p otherwise: the prompt counts, and each choice
    logits = np.array([2.0, 1.5, -1.0, -1.2], dtype=np.float32)
    penalized = Sampler(SamplingParams(**greedy, repetition_penalty=2.0), 4, prompt=[0, 2])
    assert penalized.choose(logits)[0] == 1  # 2.0 / 2 = 1.0 < 1.5
    assert penalized.choose(logits)[0] == 0  # now 1.5 / 2 = 0.75 < 1.0
    negative = Sampler(SamplingParams(**greedy, repetition_penalty=2.0), 4, prompt=[2])
    assert negative.choose(np.array([-3.0, -2.5, -1.0, -1.9], dtype=np.float32))[0] == 3  # -1.0 * 2 = -2.0 < -1.9
    # min_p 1: only the likeliest token stays, so sampling is greedy; min_p 0.5 keeps 0.5 and 0.3 (>= 0.25)
    assert set(draw(SamplingParams(seed=3, min_p=1.0)).nonzero()[0]) == {0}
    assert set(draw(SamplingParams(seed=4, min_p=0.5)).nonzero()[0]) == {0, 1}


def test_stop_token_ids_end_a_sequence_even_with_ignore_eos():
    from trtserve.runtime.sampling import finish_reason

    params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(7,))
    assert finish_reason(7, params, {2}, 1, 5, 100) == "stop"
    assert finish_reason(2, params, {2}, 1, 5, 100) is None


@pytest.mark.parametrize(("content", "message"), [
    ('{"temperature": 3}', "temperature is 3; a sampling default must be in [0, 2]"),
    ('{"top_k": 2.5}', "top_k is 2.5"),
    ('{"repetition_penalty": 0}', "repetition_penalty is 0"),
    ('{"top_p": "high"}', "top_p is 'high'"),
    ("{not json", "is not readable JSON"),
])
def test_generation_config_defaults_out_of_range_are_refused_by_name(tmp_path, content, message):
    from trtserve.errors import EngineDirError
    from trtserve.runtime.generation_defaults import generation_defaults

    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(EngineDirError, match="--generation-config none") as caught:
        generation_defaults(tmp_path)
    assert message in str(caught.value)


def test_generation_config_gives_only_the_sampling_fields_it_sets(tmp_path):
    from trtserve.runtime.generation_defaults import generation_defaults

    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, '
        '"max_new_tokens": 9, "min_p": null, "eos_token_id": [1, 2]}')
    assert generation_defaults(tmp_path) == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05}


TEMPLATES = {  # what chat templates of the served families lean on, each against transformers' own rendering
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
                     "[{{ m.role }}] {{ m.content }}{% if loop.index > 2 %}{% break %}{% endif %}\n{% endfor %}",
    "tojson keeps <, > and non-ASCII": "{{ messages | tojson }}|{{ tools | tojson(indent=2) }}",
    "namespace and dict": "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
                          "{{ ns.n }} {{ dict(a=1) | tojson }} {{ dict.fromkeys(['x']) | tojson }}",
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
                      "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ eos_token }}{% endfor %}"
                      "{% if add_generation_prompt %}<a>{% endif %}",
    "date and kwargs": "{{ strftime_now('%Y') }} {{ enable_thinking | default(true) }} {{ bos_token }}"
                       "{{ messages[-1].content }}",
}
MESSAGES = [{"role": "system", "content": "Sé breve <b>"}, {"role": "user", "content": "2 < 3 & \"ok\"?"},
            {"role": "assistant", "content": "Oui"}, {"role": "user", "content": "Encore"}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("continued", [False, True])
def test_chat_templates_render_as_transformers_renders_them(name, continued):
    pytest.importorskip("transformers", reason="needs transformers: pip install -e .[export]")
    from transformers.utils.chat_template_utils import render_jinja_template

    tools = [{"type": "function", "function": {"name": "f", "description": "<x> é", "parameters": {}}}]
    messages = MESSAGES[:3] if continued else MESSAGES
    kwargs = {"enable_thinking": False} if name == "date and kwargs" else {}
    special = {"bos_token": "<s>", "eos_token": "</s>"}
    renderer = ChatRenderer(TEMPLATES[name], special)
    if continued and "content" not in TEMPLATES[name]:  # transformers refuses it too: nothing to continue
        with pytest.raises(BadRequest, match="never reads a message's content"):
            renderer.render(messages, False, tools, True)
        return
    ours = renderer.render(messages, not continued, tools, continued, kwargs or None)
    theirs, _ = render_jinja_template([messages], tools=tools, chat_template=TEMPLATES[name],
                                      add_generation_prompt=not continued, continue_final_message=continued,
                                      **special, **kwargs)
    assert ours == theirs[0]


def test_chat_template_failures_are_400s_naming_the_field():
    renderer = ChatRenderer("{{ messages[0].content }}{{ limit + 1 }}")
    with pytest.raises(BadRequest, match="chat_template_kwargs.messages is set by the request itself"):
        renderer.render(MESSAGES, kwargs={"messages": []})
    with pytest.raises(BadRequest, match="failed on this request: TypeError") as caught:
        renderer.render(MESSAGES, kwargs={"limit": "ten"})
    assert caught.value.param == "chat_template_kwargs"
    with pytest.raises(BadRequest, match="does not keep the final message whole"):  # it cuts every content short
        ChatRenderer("{% for m in messages %}{{ m.content[:3] }}{% endfor %}").render(MESSAGES, False,
                                                                                      continue_final_message=True)
    sneaky = ChatRenderer("{% set ns = namespace() %}{% set ns._x = 1 %}{{ ns }}")
    with pytest.raises(BadRequest, match="cannot set '_x'"):
        sneaky.render(MESSAGES)


def test_a_request_that_rules_out_every_token_is_the_callers_400_and_long_inline_templates_load():
    from trtserve.runtime.events import Failure, failed
    from trtserve.runtime.sampling import RuledOut, SamplingError
    from trtserve.server.chat import template_option
    from trtserve.server.generation import _event_error

    held = Sampler(SamplingParams(allowed_token_ids=(2,), min_tokens=2), 4, eos_ids={2})
    with pytest.raises(RuledOut, match="no token is left to choose") as ruled_out:
        held.choose(LOGITS)
    event = failed("s", ruled_out.value)  # the sequence's last event, by the kind of its failure
    assert event.failure is Failure.RULED_OUT and event.ended
    error = _event_error(event, 0)
    assert isinstance(error, BadRequest) and error.status == 400
    nan = Sampler(SamplingParams(), 4, eos_ids={2})
    with pytest.raises(SamplingError, match="not finite") as broken:
        nan.choose(np.full(4, np.nan, np.float32))
    assert not isinstance(broken.value, RuledOut)
    assert failed("s", broken.value).failure is Failure.SEQUENCE
    assert _event_error(failed("s", broken.value), 0).status == 500  # the server's failure, not the caller's
    inline = "{% for m in messages %}{{ m.content }}{% endfor %}" * 20  # longer than a file name may be
    assert template_option(inline) == inline
