"""Fields of OpenAI's and vLLM's completions and chat requests that this server does not apply. A request that
sets one to anything but its neutral value gets a 400 naming it, never an answer that silently differs from
what was asked; fields nobody lists stay accepted and logged (DESIGN.md). docs/api-fields.md has the whole
table, the applied fields included."""

from __future__ import annotations

from trtserve.server.errors import BadRequest

# field -> (values that ask for nothing, why it is refused)
UNSERVED: dict[str, tuple[tuple, str]] = {
    # OpenAI
    "suffix": ((None, ""), "insertion (text after the completion) is not served"),
    "best_of": ((None, 1), "best_of is not served: ask for `n` choices and pick"),
    "audio": ((None,), "audio output is not served"),
    "modalities": ((None, ["text"]), "only text output is served"),
    "prediction": ((None,), "predicted outputs are not served"),
    "functions": ((None, []), "the deprecated `functions`: give `tools`"),
    "function_call": ((None, "none"), "the deprecated `function_call`: give `tool_choice`"),
    "store": ((None, False), "answers are not stored"),
    "web_search_options": ((None,), "web search is not served"),
    "reasoning_effort": ((None,), "the served models do not reason in a separate channel"),
    "verbosity": ((None,), "the served models take no verbosity setting"),
    # vLLM
    "echo": ((None, False), "chat's echo (the last message again) is not served; completions take `echo`"),
    "use_beam_search": ((None, False), "beam search is not served"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search, which is not served"),
    "include_stop_str_in_output": ((None, False), "stop strings are always cut from the output"),
    "skip_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "spaces_between_special_tokens": ((None, True), "special tokens are always left out of the text"),
    "truncate_prompt_tokens": ((None,), "prompts are never truncated: a prompt over the context is a 400"),
    "prompt_logprobs": ((None,), "give `echo` with `logprobs` (completions) for the prompt's logprobs"),
    "bad_words": ((None, []), "bad_words is not served: give `logit_bias` of -100 for their tokens"),
    "return_tokens_as_token_ids": ((None, False), "tokens are returned as text"),
    "logits_processors": ((None, []), "custom logits processors are not served"),
    "documents": ((None, []), "documents for retrieval-augmented templates are not served"),
    "chat_template": ((None,), "the chat template is the server's: start it with --chat-template"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not served"),
    "priority": ((None, 0), "requests are served first come, first served"),
    "kv_transfer_params": ((None,), "disaggregated prefill is not served"),
    "vllm_xargs": ((None, {}), "vLLM's extension arguments are not served"),
}


def refuse_unserved(request) -> None:
    """400 for the first field of UNSERVED that the request sets to something it would not apply."""
    for field, value in (request.model_extra or {}).items():
        known = UNSERVED.get(field)
        if known is not None and value not in known[0]:
            raise BadRequest(f"`{field}` is not applied by this server: {known[1]}", param=field)
