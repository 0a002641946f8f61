"""`/tokenize` and `/detokenize` for every engine, with vLLM's request and response shapes: a prompt
or chat messages (rendered by the model's chat template) to token ids, and ids back to text."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from starlette.requests import Request

from trtserve.server.errors import BadRequest
from trtserve.server.http import serving
from trtserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    content_text,
)

router = APIRouter()


def tokenize(service, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    if isinstance(request, TokenizeChatRequest):
        text = _rendered(service, request)
    else:
        text = request.prompt
    ids = service.tokenizer.encode(text, add_special_tokens=request.add_special_tokens).ids
    strs = [service.tokenizer.id_to_token(i) for i in ids] if request.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=service.max_seq, tokens=ids, token_strs=strs)


def _rendered(service, request: TokenizeChatRequest) -> str:
    chat = getattr(service, "chat", None)
    if chat is None:
        raise BadRequest(f"`{service.model_id}` has no chat template: tokenize a `prompt` instead", param="messages")
    for field in ("chat_template", "tools"):
        if getattr(request, field):
            raise BadRequest(f"`{field}` is not accepted here: the server's chat template renders the messages "
                             "(--chat-template sets it), and /tokenize renders no tools", param=field)
    continued = request.continue_final_message
    if continued and "add_generation_prompt" in request.model_fields_set and request.add_generation_prompt:
        raise BadRequest("`continue_final_message` and `add_generation_prompt` cannot both be true",
                         param="continue_final_message")
    messages = [{"role": m.role, "content": content_text(m.content)} for m in request.messages]
    return chat.render(messages, request.add_generation_prompt and not continued, None, continued,
                       request.chat_template_kwargs)


def detokenize(service, request: DetokenizeRequest) -> DetokenizeResponse:
    vocab = service.tokenizer.get_vocab_size(with_added_tokens=True)
    bad = next((t for t in request.tokens if t >= vocab), None)
    if bad is not None:
        raise BadRequest(f"token id {bad} is outside this model's vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=service.tokenizer.decode(request.tokens, skip_special_tokens=False))


@router.post("/tokenize")
async def tokenize_route(request: TokenizeCompletionRequest | TokenizeChatRequest, raw: Request) -> TokenizeResponse:
    service = serving(raw).engines().get(request.model)
    return await asyncio.to_thread(tokenize, service, request)  # a 2 MB prompt must not stall the loop


@router.post("/detokenize")
async def detokenize_route(request: DetokenizeRequest, raw: Request) -> DetokenizeResponse:
    return await asyncio.to_thread(detokenize, serving(raw).engines().get(request.model), request)
