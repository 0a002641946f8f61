"""OpenAI-shaped request and response models (pydantic lives only at the HTTP boundary)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

INT64 = 2**63
MAX_STOP_CHARS = 256


def _valid_unicode(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer or encoder accepts: refuse them here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid Unicode (a lone surrogate at character {exc.start})") from None
    return text


# Every string a request carries; a bad one is a 400 naming its field.
Text = Annotated[str, AfterValidator(_valid_unicode)]
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0, lt=INT64)]


class _Request(BaseModel):
    # Unknown fields are accepted (and logged by the route), as OpenAI-compatible servers do;
    # NaN and Infinity literals are refused wherever a number is expected.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class EmbeddingRequest(_Request):
    model: Text | None = None  # left out: the only engine served (vLLM, llama-server)
    input: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, lt=INT64)
    user: Text | None = None
    prompt_name: Text | None = None  # sentence-transformers / TEI: a prompt of the checkpoint, put before each text
    truncate: bool = False  # TEI: cut inputs longer than the engine's limit (keeping their start)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, lt=INT64)  # vLLM: keep the last k tokens


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "trtserve"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class _Sampling(_Request):
    """Fields that completions and chat share, with OpenAI's ranges (checked as 400s)."""

    model: Text | None = None  # left out: the only engine served (vLLM, llama-server)
    max_tokens: int | None = Field(default=None, ge=1, lt=INT64)
    # below 1e-5 a temperature is greedy decoding (as in vLLM): dividing by it would overflow
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, lt=INT64)  # an extension (vLLM's): 0 or -1 is off
    ignore_eos: bool = False  # an extension (vLLM's): generate max_tokens tokens whatever comes
    n: int = Field(default=1, ge=1, lt=INT64)
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)  # OpenAI's: a 64-bit integer
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # OpenAI's: token id (a JSON object's keys are strings) -> bias added to its logit; ids checked per engine
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # vLLM's extensions (runtime/sampling.py has their rules)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0, lt=INT64)
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=1024)
    allowed_token_ids: list[TokenId] | None = Field(default=None, min_length=1)  # only these may be chosen
    add_special_tokens: bool | None = None  # tokenizing the prompt: default true for completions, false for chat
    stop: StopText | list[StopText] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # structured outputs in vLLM's extra-body forms (server/structured.py)
    structured_outputs: dict | None = None
    guided_json: dict | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None


class CompletionRequest(_Sampling):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Text
    content: Text | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool result's call
    name: Text | None = None


def content_text(content: str | list[ContentPart] | None) -> str:
    """A chat message's content as one text (its text parts joined)."""
    if content is None:
        return ""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict | None = None  # structured outputs (server/structured.py)
    tools: list | None = None  # server/tools.py
    tool_choice: Text | dict | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call per answer
    # vLLM's: how the chat template renders the messages (server/chat.py)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


class CompletionUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# -- responses of /v1/completions and /v1/chat/completions (server/completions.py builds them); an optional
# field OpenAI's shapes leave out when empty is left out here too (`_absent`) ------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # a prompt's first token has none
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


def _absent():
    return Field(None, exclude_if=lambda value: value is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = _absent()


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = _absent()
    content: str | None = _absent()
    tool_calls: list[ToolCallDelta] | None = _absent()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


# fields in OpenAI's order; `usage`: a whole answer's, and on a chunk null but on the last (include_usage)
class CompletionResponse(BaseModel):
    """A whole completion, or one chunk of a streamed one (the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: CompletionUsage | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: CompletionUsage | None


class TokenizeCompletionRequest(_Request):
    """vLLM's /tokenize for a prompt."""

    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    """vLLM's /tokenize for chat messages, rendered by the model's chat template."""

    model: Text | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: Text | None = None
    chat_template_kwargs: dict | None = None
    tools: list | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Text


class RerankRequest(_Request):
    """POST /v1/rerank and /rerank: Cohere's and Jina's shape as vLLM serves it (`documents`,
    `return_documents`), or TEI's (`texts`, `return_text`); exactly one of the two lists. `raw_scores` (the
    logit rather than its sigmoid) applies to both."""
    model: Text | None = None
    query: Text
    documents: list[Text | Document] | None = None
    texts: list[Text] | None = None
    top_n: int | None = Field(default=None, ge=1, lt=INT64)
    return_documents: bool = True
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = False


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: Document | None = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class TeiRank(BaseModel):
    index: int
    score: float
    text: str | None = None


class ScoreRequest(_Request):
    """POST /v1/score (vLLM): text_1 against text_2, one to one, one to many or many to many (same length)."""
    model: Text | None = None
    text_1: Text | list[Text]
    text_2: Text | list[Text]
    truncate: bool = False


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: Usage
