"""Generation serving logic for decoder engines (no FastAPI here): request checks, prompts, one
async stream of text pieces per sequence with stop strings and streaming hold-back, and routing
of sequences to the workers that run the continuous batcher."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from trtserve.engine_dir.kinds import ModelKind
from trtserve.runtime.events import Event, Failure, FinishReason
from trtserve.runtime.generation_defaults import RANGES, generation_defaults
from trtserve.runtime.sampling import SamplingParams
from trtserve.runtime.text import token_ids
from trtserve.server.chat import ChatRenderer, load_chat_template, template_option
from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, Overloaded, ServingError, Unavailable
from trtserve.server.protocol import ChatCompletionRequest, CompletionRequest
from trtserve.server.service import Service
from trtserve.server.tool_parsers import parser_for

if TYPE_CHECKING:
    from trtserve.server.tools import ToolPlan

log = logging.getLogger("trtserve.server")
PROBE_TIMEOUT = 30.0
DEFAULTED = tuple(RANGES)  # the sampling fields generation_config.json may set


@dataclass
class Piece:
    """New text of one sequence, the tokens it came from, and the finish reason on the last piece."""

    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, float, list]] = field(default_factory=list)
    finish: str | None = None
    prompt_logprobs: list | None = None  # the prompt's tokens and logprobs (echo + logprobs), on the first piece


@dataclass
class Job:
    """One sequence to generate: prompt tokens, sampling, stop strings, and what to echo."""

    prompt: list[int]
    params: SamplingParams
    stop: list[str]
    echo: str = ""
    tools: ToolPlan | None = None  # the answer may be a tool call


class Submission:
    """The sequences of one request, admitted together: one async stream of Pieces per job, and
    close() to cancel whatever has not finished (idempotent)."""

    def __init__(self, streams: list, on_close=None):
        self.streams, self._on_close = streams, on_close

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


class DecoderService(Service):
    """Requests to jobs and events to pieces, for every decoder engine; how sequences run (`submit`)
    is the specialisation's (GenerationService: workers running the continuous batcher)."""

    kind = ModelKind.DECODER  # parallel-track engines too

    max_seq: int  # prompt plus generated tokens a sequence may hold
    vocab: int  # token ids a prompt may use are [0, vocab)

    def __init__(self, cfg: ServerConfig, metrics=None, verify: bool = False):
        super().__init__(cfg, metrics, verify)
        template = template_option(cfg.chat_template)
        self.chat = ChatRenderer.for_engine(self.engine.path, self.special, template)
        self.tool_parser = parser_for(template or load_chat_template(self.engine.path), cfg.tool_call_parser)
        self._lltokenizer = None
        # what requests leave out: the checkpoint's sampling defaults (--generation-config auto)
        self.defaults = generation_defaults(self.engine.path) if cfg.generation_config == "auto" else {}
        if self.defaults:
            log.info("sampling defaults from generation_config.json: %s", self.defaults)

    @property
    def lltokenizer(self):
        """The grammar library's view of the tokenizer, to check grammars with (built on first use)."""
        from trtserve.runtime.constraints import grammar_tokenizer

        if self._lltokenizer is None:
            self._lltokenizer = grammar_tokenizer(self.tokenizer, self.vocab, self.special.eos_ids)
        return self._lltokenizer

    async def grammar(self, request, tool_spec: tuple[str, object, str] | None = None) -> str | None:
        """The grammar a request's structured output (or forced tool call) compiles to, or None (400
        for a bad one)."""
        from trtserve.server.structured import compile_for, json_options, requested

        spec = requested(request)
        if spec is not None and tool_spec is not None:
            raise BadRequest("a forced tool call and a structured output cannot be combined", param="tool_choice")
        spec = spec or tool_spec
        if spec is None:
            return None
        if request.ignore_eos:
            raise BadRequest("`ignore_eos` cannot be combined with a structured output: the grammar ends it",
                             param="ignore_eos")
        return await asyncio.to_thread(compile_for, self, *spec, json_options(request))

    def submit(self, jobs: list[Job]) -> Submission:
        """Admit every job of a request, or none (429 / 503 before any byte of the answer)."""
        raise NotImplementedError

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special).ids

    # -- requests to jobs -----------------------------------------------------------------------
    async def completion_jobs(self, request: CompletionRequest) -> list[Job]:
        self.check_model(request.model)
        prompts: str | list[str] | list[int] | list[list[int]] | list[str | list[int]] = request.prompt
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise BadRequest("`prompt` is empty: give a string, a list of strings or token arrays", param="prompt")
        self._check_count(len(prompts) * request.n, request.n, "prompt")  # before any tokenizing
        grammar = await self.grammar(request)
        texts = [p for p in prompts if isinstance(p, str)]
        special = request.add_special_tokens is not False  # vLLM's default for completions: true
        encoded = iter(await asyncio.to_thread(token_ids, self.tokenizer, texts, special) if texts else [])
        jobs = []
        for prompt in prompts:
            ids = next(encoded) if isinstance(prompt, str) else list(cast("list[int]", prompt))  # no bare ints now
            if not ids:
                raise BadRequest("`prompt` has no tokens: give some text", param="prompt")
            if any(not 0 <= t < self.vocab for t in ids):
                raise BadRequest(f"prompt token ids must be in [0, {self.vocab})", param="prompt")
            echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if request.echo else ""
            scored = request.logprobs if request.echo else None  # echo + logprobs: the prompt's logprobs too
            jobs += self._fan_out(request, ids, request.max_tokens or 16, request.logprobs, echo, scored, grammar)
        self._check_tokens(jobs)
        return jobs

    async def chat_jobs(self, request: ChatCompletionRequest) -> list[Job]:
        self.check_model(request.model)
        if self.chat is None:
            raise BadRequest(f"`{self.model_id}` has no chat template in its tokenizer config: use /v1/completions "
                             "with a prompt you format yourself", param="messages")
        from trtserve.server import tools

        tool_plan = tools.plan(request, self.tool_parser)
        if request.top_logprobs is not None and not request.logprobs:
            raise BadRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        self._check_count(request.n, request.n, "n")
        grammar = await self.grammar(request, tools.grammar_spec(tool_plan))
        messages = tools.messages_for(request.messages, tool_plan, self.chat.takes_tools)
        listed = [{"type": "function", "function": f} for f in tool_plan.tools.values()] if tool_plan else None
        continued = request.continue_final_message
        if continued and "add_generation_prompt" in request.model_fields_set and request.add_generation_prompt:
            raise BadRequest("`continue_final_message` and `add_generation_prompt` cannot both be true",
                             param="continue_final_message")
        prompt = await asyncio.to_thread(self.chat.render, messages, request.add_generation_prompt and not continued,
                                         listed if self.chat.takes_tools else None, continued,
                                         request.chat_template_kwargs)
        special = bool(request.add_special_tokens)  # vLLM's default for chat: false (the template has them)
        ids = (await asyncio.to_thread(token_ids, self.tokenizer, [prompt], special))[0]
        limit = request.max_completion_tokens or request.max_tokens or max(self.max_seq - len(ids), 1)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        jobs = self._fan_out(request, ids, limit, logprobs, "", grammar=grammar)
        for job in jobs:
            job.tools = tool_plan
        self._check_tokens(jobs)
        return jobs

    def _check_count(self, sequences: int, n: int, param: str) -> None:
        """A request can never hold more sequences than one worker queues: 400, since retrying cannot help."""
        if n > self.cfg.max_n:
            raise BadRequest(f"`n` is {n}; this server allows at most {self.cfg.max_n} (--max-n)", param="n")
        if sequences > self.cfg.max_queue:
            raise BadRequest(f"this request asks for {sequences} sequences (prompts x n); this server queues at "
                             f"most {self.cfg.max_queue} per worker (--max-queue): split the request", param=param)

    def _check_tokens(self, jobs: list[Job]) -> None:
        tokens = sum(len(j.prompt) for j in jobs)
        if tokens > self.cfg.max_queue_tokens:
            raise BadRequest(f"this request's prompts hold {tokens} tokens (counting each of `n` choices); this "
                             f"server queues at most {self.cfg.max_queue_tokens} per worker (--max-queue-tokens): "
                             "split the request", param="prompt")

    def _fan_out(self, request, ids: list[int], max_tokens: int, logprobs: int | None, echo: str,
                 prompt_logprobs: int | None = None, grammar: str | None = None) -> list[Job]:
        if len(ids) + max_tokens > self.max_seq:
            raise BadRequest(f"the prompt has {len(ids)} tokens and max_tokens is {max_tokens}: "
                             f"{len(ids) + max_tokens} is over this engine's context of {self.max_seq} tokens; "
                             "shorten the prompt or lower max_tokens",
                             param="max_tokens", code="context_length_exceeded")
        stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
        if len(stop) > 4:
            raise BadRequest("`stop` takes up to 4 non-empty strings", param="stop")
        if request.min_tokens > max_tokens:
            raise BadRequest(f"min_tokens ({request.min_tokens}) is over max_tokens ({max_tokens})", param="min_tokens")
        sampling = self._sampling(request)
        jobs = []
        for i in range(request.n):
            params = SamplingParams(
                max_tokens=max_tokens, seed=None if request.seed is None else request.seed + i, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, grammar=grammar, **sampling)
            jobs.append(Job(ids, params, stop, echo))
        return jobs

    def _sampling(self, request) -> dict:
        """The request's sampling fields, checked against this engine's vocabulary; the ones it leaves out that
        the checkpoint's generation_config.json sets come from there (--generation-config auto)."""
        chosen = {name: getattr(request, name) for name in DEFAULTED}
        chosen.update({name: value for name, value in self.defaults.items() if name not in request.model_fields_set})
        bias = []
        for key, value in (request.logit_bias or {}).items():
            if not key.isdecimal() or int(key) >= self.vocab:
                raise BadRequest(f"logit_bias keys are token ids in [0, {self.vocab}); {key!r} is not one",
                                 param="logit_bias")
            bias.append((int(key), value))
        stops = tuple(request.stop_token_ids or ())
        allowed = tuple(request.allowed_token_ids or ())
        for name, ids in (("stop_token_ids", stops), ("allowed_token_ids", allowed)):
            if any(t >= self.vocab for t in ids):
                raise BadRequest(f"{name} must be token ids in [0, {self.vocab})", param=name)
        return {**chosen, "allowed_token_ids": allowed, "top_k": max(chosen["top_k"], 0), "logit_bias": tuple(bias),
                "stop_token_ids": stops, "min_tokens": request.min_tokens, "presence_penalty": request.presence_penalty,
                "frequency_penalty": request.frequency_penalty, "ignore_eos": request.ignore_eos}

    # -- one sequence ---------------------------------------------------------------------------
    async def pieces(self, job: Job, next_event, where: int):
        """Pieces from a sequence's events (runtime.events.Event)."""
        from tokenizers.decoders import DecodeStream

        ids: list[int]
        ids, logprobs, sent, done, tokens_sent, scored = [], [], "", False, 0, None
        decoder, text = DecodeStream(skip_special_tokens=True), ""  # incremental: O(1) per token
        started = last = time.perf_counter()
        while not done:
            event = await next_event()
            if event.failure is not None:
                raise _event_error(event, where)
            now = time.perf_counter()
            self._observe("ttft" if not ids and last == started else "itl", now - last)
            last = now
            finish = None if event.finish is None else event.finish.value  # the API's finish_reason
            scored = event.prompt_logprobs or scored
            if event.token >= 0:
                ids.append(event.token)
                self._observe("tokens", 1)
                if event.logprob is not None:
                    logprobs.append((event.token, event.logprob, event.top_logprobs))
                text += decoder.step(self.tokenizer, event.token) or ""  # None: half a character so far
            if finish is not None:  # the whole decode once, so the final text is exactly decode(ids)
                text = self.tokenizer.decode(ids)
            cut = _first_stop(text, job.stop, len(sent)) if len(ids) >= job.params.min_tokens else None
            if cut is not None:
                text, finish = text[:cut], FinishReason.STOP.value
            done = finish is not None
            safe = len(text) if done else _safe_end(text, job.stop)
            if done or (safe > len(sent) and text.startswith(sent)):
                delta = text[len(sent):safe] if text.startswith(sent) else ""
                yield Piece(delta, ids[tokens_sent:], logprobs, finish, scored)
                tokens_sent, logprobs, sent, scored = len(ids), [], text[:safe], None
        if len(ids) > 1:
            self._observe("tpot", (last - started) / len(ids))

    def _observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_generation(name, value)


class GenerationService(DecoderService):
    """A decoder engine over worker processes (or the in-process worker), each running the
    continuous batcher (server/generation_worker.py). A track-sharded engine is one such worker whose
    backend's ranks share its tracks (runtime/track_backend.py)."""

    def __init__(self, cfg: ServerConfig, metrics=None):
        super().__init__(cfg, metrics)  # every worker verifies the engine's files
        tracks = self.manifest.parallel_tracks
        self.max_running = cfg.max_num_seqs  # a worker's batcher runs at most the engine's batch limit
        if tracks is None:
            assert self.manifest.shapes is not None and self.manifest.shapes.total_sequence is not None  # a decoder's
            self.max_running = min(cfg.max_num_seqs, self.manifest.shapes.batch.max)
            self.max_seq = self.manifest.shapes.total_sequence.max
            self.vocab = self.manifest.model.architecture.vocab_size
            ranks = None
        else:  # its compact vocabulary is mapped to and from the tokenizer's ids by its backend
            from trtserve.server.workers import LOAD_TIMEOUT

            check_tracks_option(cfg.engine_dir, self.manifest, cfg.tracks, cfg.workers)
            self.max_seq = self.manifest.model.architecture.max_positions
            self.vocab = self.tokenizer.get_vocab_size()
            ranks = {"tracks": cfg.tracks or tracks.tracks, "threads": cfg.threads or 1,
                     "timeout": cfg.worker_timeout, "heartbeat": cfg.heartbeat_timeout, "start_timeout": LOAD_TIMEOUT}
            log.info("tracks: %d engine tracks over %d rank process(es), %d all-reduce(s) per forward",
                     tracks.tracks, ranks["tracks"], tracks.sync.per_forward)
        options = {"max_num_seqs": cfg.max_num_seqs, "max_batched_tokens": max(cfg.max_batch_tokens, self.max_seq),
                   "max_prefill_tokens": cfg.max_prefill_tokens or None, "prefix_cache_mib": cfg.prefix_cache_mib}
        self.pool = self.worker_pool(generation=options, ranks=ranks)

    async def start(self) -> None:
        await self.pool.start()
        if self.metrics is not None:  # read when /metrics is scraped, so never stale
            self.metrics.running_seqs.set_function(lambda: self._sequences("running"))
            self.metrics.waiting_seqs.set_function(lambda: self._sequences("waiting"))
        await self.probe()

    async def stop(self) -> None:
        await self.pool.stop()

    async def probe(self) -> None:
        await self.pool.probe(self._probe_on)

    async def _probe_on(self, worker) -> None:
        if worker.channel is None or worker.channel.closed:
            raise Unavailable(f"worker {worker.index} is restarting")
        job = Job(self.tokenize("Hello"), SamplingParams(max_tokens=1, temperature=0), [])
        submission = self._open([job], worker)
        try:
            async with asyncio.timeout(PROBE_TIMEOUT):
                async for _ in submission.streams[0]:
                    pass
        finally:
            submission.close()

    def healthy(self, within: float) -> bool:
        return self.pool.healthy(within)

    def workers(self) -> list[dict]:
        return self.pool.status()

    # -- admission --------------------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> Submission:
        """Admit every job of a request on one worker, or none: 429 when no worker has room for
        them (--max-num-seqs running, at most the engine's batch limit, + --max-queue waiting sequences,
        --max-queue-tokens prompt tokens), 503 when no worker is ready. Known before any byte of the answer is sent."""
        ready = [w for w in self.pool.workers if w.ready and w.channel is not None and not w.channel.closed]
        if not ready:
            raise Unavailable(f"no worker is ready ({len(self.pool.workers)} restarting); retry shortly")
        tokens = sum(len(j.prompt) for j in jobs)
        room = [w for w in ready if len(w.channel.streams) + len(jobs) <= self.max_running + self.cfg.max_queue
                and w.channel.queued_tokens() + tokens <= self.cfg.max_queue_tokens]
        if not room:
            raise Overloaded(f"every worker is full ({self.max_running} running and {self.cfg.max_queue} waiting "
                             f"sequences, {self.cfg.max_queue_tokens} prompt tokens each); retry shortly")
        return self._open(jobs, min(room, key=lambda w: w.load_now))

    def _open(self, jobs: list[Job], worker) -> Submission:
        opened = [(job, *ids) for job, ids in zip(jobs, worker.channel.open([(j.prompt, j.params) for j in jobs]))]

        def close():
            for _, seq_id, _ in opened:
                worker.channel.close(seq_id)

        streams = [self.pieces(job, queue.get, worker.index) for job, _, queue in opened]
        return Submission(streams, close)

    def _sequences(self, state: str) -> int:
        """Sequences in the workers' batches (running) or queues (waiting), as they last reported."""
        return sum(getattr(w.channel, state) for w in self.pool.workers if w.channel is not None and w.ready)


def _first_stop(text: str, stops: list[str], sent: int) -> int | None:
    """Index of the earliest stop string in `text` (searching from where it could first appear)."""
    hits = [i for s in stops if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def _safe_end(text: str, stops: list[str]) -> int:
    """How much of `text` can be sent: not a trailing U+FFFD (half a character), not a suffix that
    could grow into a stop string."""
    end = len(text.rstrip("\ufffd"))
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:k]):
                hold = max(hold, k)
                break
    return end - hold


def _event_error(event: Event, worker: int) -> ServingError:
    """The answer to a sequence that ended on a failure, by its kind."""
    from trtserve.runtime.sampling import RULED_OUT

    if event.failure is Failure.RULED_OUT:
        return BadRequest(RULED_OUT)
    if event.failure is Failure.WORKER_DIED:
        return Unavailable(f"worker {worker} stopped while generating this sequence; retry the request")
    if event.failure is Failure.WORKER_HUNG:
        return Unavailable(f"worker {worker} stopped making progress and is being restarted; retry the request")
    return ServingError(f"the backend failed while generating: {event.error}")


def check_tracks_option(engine_dir, manifest, tracks: int | None, workers: int | None = None) -> None:
    """`--tracks N` is for track-sharded engines only, and N must divide their tracks; such an engine is served
    by one worker (its ranks are the processes), or in the server process with `--workers 0`."""
    from trtserve.errors import TrtServeError
    from trtserve.runtime.sharded import check_track_split

    if manifest.parallel_tracks is None:
        if tracks is not None:
            raise TrtServeError(f"--tracks is for track-sharded engines (built from a parallel-track checkpoint); "
                                f"{engine_dir} is not one (its model kind is {manifest.model.kind}): "
                                "leave --tracks out")
        return
    if workers is not None and workers > 1:
        raise TrtServeError(f"{engine_dir} is track-sharded: one worker serves it, its --tracks rank processes "
                            f"sharing the tracks; --workers {workers} cannot apply (use 1, or 0 for the server "
                            "process)")
    if tracks is not None:
        check_track_split(manifest.parallel_tracks.tracks, tracks)
