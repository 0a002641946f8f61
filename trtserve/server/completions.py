"""OpenAI response shapes for /v1/completions and /v1/chat/completions, whole or streamed as
server-sent events (`data: {chunk}` lines, `data: [DONE]` last; an error after the stream began is
sent as a final data event in the error shape)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from starlette.responses import StreamingResponse

from trtserve.server.errors import ServingError, Timeout
from trtserve.server.generation import GenerationService, Job, Submission
from trtserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    CompletionUsage,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
)


async def _merged(submission: Submission, deadline: Deadline):
    """(choice index, Piece) from every stream as they come, until all finished; Timeout once the
    deadline passes. Closes the submission (cancelling what has not finished) at the end."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, pieces):
        try:
            async for piece in pieces:
                await queue.put((index, piece))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(submission.streams)]
    finished = 0
    try:
        while finished < len(tasks):
            index, item = await _get_before(queue, deadline)
            if isinstance(item, Exception):
                raise item
            finished += item.finish is not None
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        submission.close()


class Deadline:
    """When a request must be answered by: `seconds` from now on the monotonic clock."""

    def __init__(self, seconds: float):
        self.seconds, self.at = seconds, time.monotonic() + seconds


async def _get_before(queue: asyncio.Queue, deadline: Deadline):
    """queue.get() until the deadline. Not asyncio.wait_for: on Python 3.11 an item that arrives as
    the timeout fires is lost with it."""
    getter = asyncio.ensure_future(queue.get())
    done, _ = await asyncio.wait({getter}, timeout=max(deadline.at - time.monotonic(), 0))
    if getter not in done:
        getter.cancel()
        try:
            return await getter  # it may have completed just before the cancel
        except asyncio.CancelledError:
            raise Timeout(f"the request took longer than {deadline.seconds:g} s (--request-timeout)") from None
    return getter.result()


class _Shape:
    """What differs between the two endpoints: the response models, where text goes, logprob format."""

    def __init__(self, service: GenerationService, chat: bool, model: str):
        self.service, self.chat, self.model = service, chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def envelope(self, choices: list, usage: CompletionUsage | None, chunk: bool):
        kind = (ChatCompletionChunk if chunk else ChatCompletionResponse) if self.chat else CompletionResponse
        return kind(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def logprobs(self, entries: list, offset: int = 0) -> ChatLogprobs | CompletionLogprobs | None:
        if not entries:
            return None
        decode = self.service.tokenizer.decode

        def top(token: int, logprob: float) -> dict:
            return {"token": decode([token]), "logprob": logprob, "bytes": list(decode([token]).encode())}

        if self.chat:
            return ChatLogprobs(content=[TokenLogprob(**top(t, lp),
                                                      top_logprobs=[TopLogprob(**top(k, v)) for k, v in alt])
                                         for t, lp, alt in entries])
        tokens = [decode([t]) for t, _, _ in entries]
        offsets = [offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[lp for _, lp, _ in entries],
            top_logprobs=[None if alt is None else {decode([k]): v for k, v in alt} for _, _, alt in entries],
            text_offset=offsets)  # a prompt's first token has no logprob: None, as in OpenAI's and vLLM's

    def choice(self, index: int, text: str, finish: str | None, logprobs, chunk: bool, first: bool = False):
        if not self.chat:
            return CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        if chunk:
            delta = ChatDelta(role="assistant", content=text) if first else ChatDelta(content=text or None)
            return ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return ChatChoice(index=index, message=AssistantMessage(content=text), logprobs=logprobs, finish_reason=finish)


def _usage(jobs: list[Job], completion_tokens: int) -> CompletionUsage:
    prompt = sum(len(j.prompt) for j in {id(j.prompt): j for j in jobs}.values())
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion_tokens,
                           total_tokens=prompt + completion_tokens)


async def complete(service: GenerationService, jobs: list[Job], submission: Submission, chat: bool, model: str,
                   deadline: Deadline) -> dict:
    """The whole answer, as the JSON body of ChatCompletionResponse or CompletionResponse."""
    shape = _Shape(service, chat, model)
    texts = [job.echo for job in jobs]
    entries: list[list] = [[] for _ in jobs]
    prompts: list[list] = [[] for _ in jobs]  # echo + logprobs: the prompt's tokens come first
    finish: list[str | None] = [None] * len(jobs)
    ids: list[list[int]] = [[] for _ in jobs]  # each answer's tokens, for a tool parser that reads special ones
    tokens = 0
    async for index, piece in _merged(submission, deadline):
        texts[index] += piece.text
        ids[index] += piece.tokens
        entries[index] += piece.logprobs
        prompts[index] = piece.prompt_logprobs or prompts[index]
        tokens += len(piece.tokens)
        finish[index] = piece.finish or finish[index]
    choices = [shape.choice(i, texts[i], finish[i], shape.logprobs(prompts[i] + entries[i], 0 if prompts[i] else
                                                                   len(jobs[i].echo)), chunk=False)
               for i in range(len(jobs))]
    for i, choice in enumerate(choices):
        found = _calls(service, jobs[i], texts[i], ids[i], finish[i])
        if found:  # the answer is a call: the text before it (if any) as content, OpenAI's finish reason
            choice.message = AssistantMessage(content=found[0], tool_calls=found[1])
            choice.finish_reason = "tool_calls"
    return shape.envelope(choices, _usage(jobs, tokens), chunk=False).model_dump()


def _calls(service, job: Job, text: str, ids: list[int], finish: str | None) -> tuple[str | None, list] | None:
    """(content, tool calls) of a finished chat answer (server/tools.py), or None."""
    if job.tools is None or finish != "stop":
        return None
    from trtserve.server.tools import read_answer

    return read_answer(job.tools, text, service.tokenizer.decode(ids, skip_special_tokens=False))


async def stream(service: GenerationService, jobs: list[Job], submission: Submission, chat: bool, model: str,
                 include_usage: bool, deadline: Deadline):
    """Server-sent events, ready to write. An error after the first byte (a worker lost, the
    deadline passed) is a last event in the error shape, then [DONE]."""
    shape = _Shape(service, chat, model)
    tokens, started = 0, set()
    offsets = [len(job.echo) for job in jobs]
    # tools: text, logprobs, ids
    held: dict[int, list] = {i: ["", [], []] for i, job in enumerate(jobs) if job.tools is not None}
    try:
        for index, job in enumerate(jobs):  # the first chunk of each choice: the role, or the echoed prompt
            if chat or (job.echo and job.params.prompt_logprobs is None):
                started.add(index)
                yield _event(shape.envelope([shape.choice(index, job.echo, None, None, True, first=True)], None, True))
        async for index, piece in _merged(submission, deadline):
            if index not in started and jobs[index].echo:  # the echo held back for the prompt's logprobs
                started.add(index)
                scored = shape.logprobs(piece.prompt_logprobs, 0) if piece.prompt_logprobs else None
                yield _event(shape.envelope([shape.choice(index, jobs[index].echo, None, scored, True)], None, True))
            tokens += len(piece.tokens)
            if index in held:  # an answer that may be a tool call is sent once it is whole
                held[index][0] += piece.text
                held[index][1] += piece.logprobs
                held[index][2] += piece.tokens
                if piece.finish:
                    text, entries, ids = held[index]
                    for event in _held_answer(shape, index, text, entries, ids, piece.finish, jobs[index]):
                        yield event
                continue
            if not piece.text and not piece.finish and not piece.logprobs:
                continue
            first = chat and index not in started
            started.add(index)
            logprobs = shape.logprobs(piece.logprobs, offsets[index])
            offsets[index] += len(piece.text)
            yield _event(shape.envelope([shape.choice(index, piece.text, piece.finish, logprobs, True, first)],
                                        None, True))
        if include_usage:
            yield _event(shape.envelope([], _usage(jobs, tokens), chunk=True))
    except ServingError as exc:
        yield _event({"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}})
    except Exception as exc:  # noqa: BLE001 - the stream has begun: the client must get an error event
        yield _event({"error": {"message": f"generation failed: {type(exc).__name__}: {exc}",
                                "type": "internal_error", "param": None, "code": None}})
    finally:
        submission.close()
    yield "data: [DONE]\n\n"


def _held_answer(shape: _Shape, index: int, text: str, entries: list, ids: list[int], finish: str, job: Job):
    """The chunks of a whole answer: its content (the text before a call), a tool-call delta and the finish; or
    the text as content."""
    logprobs = shape.logprobs(entries)
    found = _calls(shape.service, job, text, ids, finish)
    if not found:
        yield _event(shape.envelope([shape.choice(index, text, finish, logprobs, True)], None, True))
        return
    content, calls = found
    if content:
        yield _event(shape.envelope([ChatChunkChoice(index=index, delta=ChatDelta(content=content), logprobs=None,
                                                     finish_reason=None)], None, True))
    delta = ChatDelta(tool_calls=[ToolCallDelta(index=k, **call) for k, call in enumerate(calls)])
    assert logprobs is None or isinstance(logprobs, ChatLogprobs)  # a chat answer's
    yield _event(shape.envelope([ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=None)],
                                None, True))
    yield _event(shape.envelope([ChatChunkChoice(index=index, delta=ChatDelta(), logprobs=None,
                                                 finish_reason="tool_calls")], None, True))


def _event(body) -> str:
    """One server-sent event: a response model (a chunk), or an error body."""
    return f"data: {json.dumps(body if isinstance(body, dict) else body.model_dump(), ensure_ascii=False)}\n\n"



class SequenceStream(StreamingResponse):
    """The SSE response of a stream; its sequences are closed whatever happens to the response
    (a generator Starlette never started would never run its own cleanup)."""

    def __init__(self, events, submission: Submission):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.submission = submission

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.submission.close()
