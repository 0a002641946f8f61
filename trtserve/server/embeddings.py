"""Embedding serving logic: validation, tokenization, batching, response shapes. No FastAPI here."""

from __future__ import annotations

import asyncio
import base64
import logging

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, Timeout
from trtserve.server.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, Usage
from trtserve.server.scheduler import DynamicBatcher
from trtserve.server.service import Service

log = logging.getLogger("trtserve.server")


class EmbeddingService(Service):
    """Validation and tokenization here; the backend runs in the workers, fed by one batcher."""

    kind = ModelKind.ENCODER  # make_service gives decoder engines to GenerationService

    def __init__(self, cfg: ServerConfig, metrics=None):
        super().__init__(cfg, metrics)  # every worker verifies the engine's files
        architecture, pooling = self.manifest.model.architecture, self.manifest.pooling
        self.dim = pooling.dimensions if pooling else architecture.hidden_size
        self.vocab = architecture.vocab_size
        self.normalizes = pooling.normalize if pooling else True
        self.prompts = dict(pooling.prompts) if pooling else {}
        self.default_prompt = pooling.default_prompt_name if pooling else None
        assert self.manifest.shapes is not None
        self.max_seq = self.manifest.shapes.sequence.max
        self.pool = self.worker_pool()
        engine_max = self.manifest.shapes.batch.max
        self.batcher = DynamicBatcher(self.pool.run, min(cfg.max_batch, engine_max), cfg.max_wait_ms, cfg.max_queue,
                                      max_tokens=max(cfg.max_batch_tokens, self.max_seq),
                                      concurrency=len(self.pool.workers), metrics=metrics)
        self._probe_rows = [self.tokenize(["health probe"])[0]]

    async def start(self) -> None:
        await self.pool.start()
        self.batcher.start()
        await self.probe()  # warm up: the server reports ready only after a real inference on every worker

    async def stop(self) -> None:
        await self.batcher.stop()
        await self.pool.stop()

    async def probe(self) -> None:
        await self.pool.probe(lambda worker: self.pool.run(self._probe_rows, worker))

    def healthy(self, within: float) -> bool:
        return self.pool.healthy(within)

    def workers(self) -> list[dict]:
        return self.pool.status()

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        from trtserve.runtime.text import token_ids

        return token_ids(self.tokenizer, texts)

    def rows(self, request: EmbeddingRequest) -> list[list[int]]:
        self.check_model(request.model)
        if request.dimensions is not None and request.dimensions > self.dim:
            raise BadRequest(f"`dimensions` {request.dimensions} is above `{self.model_id}`'s {self.dim}: give at most "
                             f"{self.dim} (the first `dimensions` values are kept)", param="dimensions")
        items: str | list[str] | list[int] | list[list[int]] | list[str | list[int]] = request.input
        if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
            items = [items]
        if not items:
            raise BadRequest("`input` is empty: give a string, a list of strings or token arrays", param="input")
        texts = [i for i in items if isinstance(i, str)]
        if any(not t for t in texts):
            raise BadRequest("`input` contains an empty string", param="input")
        rows = [r for r in items if isinstance(r, list)]
        if texts and rows:
            raise BadRequest("`input` mixes strings and token arrays", param="input")
        limit = self._limit(request)
        if rows:
            if request.prompt_name is not None:
                raise BadRequest("`prompt_name` applies to text inputs, not token arrays", param="prompt_name")
            if any(not r for r in rows) or any(not 0 <= t < self.vocab for r in rows for t in r):
                raise BadRequest(f"token arrays must be non-empty with ids in [0, {self.vocab})", param="input")
            if limit is not None:
                rows = [r[:limit] if request.truncate else r[-limit:] for r in rows]
        else:
            texts = [self._prompt(request.prompt_name) + t for t in texts]
            if limit is None:
                rows = self.tokenize(texts)
            else:
                from trtserve.runtime.text import truncated_ids

                try:
                    rows = truncated_ids(self.tokenizer, texts, limit, "right" if request.truncate else "left")
                except ValueError as exc:
                    raise BadRequest(str(exc), param="truncate_prompt_tokens") from None
        self.check_queue(len(rows), "input")
        longest = max(map(len, rows))
        if longest > self.max_seq:
            raise BadRequest(f"an input has {longest} tokens; this engine's limit is {self.max_seq} tokens "
                             "(`truncate`: true or `truncate_prompt_tokens` cut it)", param="input",
                             code="context_length_exceeded")
        return rows

    def check_queue(self, items: int, field: str) -> None:
        if items > self.cfg.max_queue:
            raise BadRequest(f"`{field}` has {items} items; this server queues at most {self.cfg.max_queue} "
                             "(--max-queue): split the request", param=field)

    def _limit(self, request: EmbeddingRequest) -> int | None:
        """The longest row the request allows: `truncate` cuts to the engine's limit keeping the start (TEI);
        `truncate_prompt_tokens` k keeps the last k tokens, -1 the engine's limit (vLLM)."""
        k = request.truncate_prompt_tokens
        if request.truncate and k is not None:
            raise BadRequest("give `truncate` or `truncate_prompt_tokens`, not both", param="truncate_prompt_tokens")
        if k is not None and (k == 0 or k > self.max_seq):
            raise BadRequest(f"`truncate_prompt_tokens` must be -1 or 1..{self.max_seq} (the engine's limit), got {k}",
                             param="truncate_prompt_tokens")
        return self.max_seq if request.truncate or k == -1 else k

    def _prompt(self, name: str | None) -> str:
        if name is None:
            return self.prompts.get(self.default_prompt, "") if self.default_prompt else ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none: its config_sentence_transformers.json lists no prompts"
            raise BadRequest(f"`prompt_name` {name!r} is not one of `{self.model_id}`'s prompts ({known})",
                             param="prompt_name")
        return self.prompts[name]

    def _shorten(self, vector: np.ndarray, size: int) -> np.ndarray:
        """Matryoshka: the first `size` values, normalized again where the model normalizes its vectors."""
        vector = np.asarray(vector, np.float32)[:size]
        return vector / max(float(np.linalg.norm(vector)), 1e-12) if self.normalizes else vector

    async def encode(self, rows: list[list[int]]) -> list:
        """Each row's result from the batcher (TextEngine.encode_ids), in order, within the request timeout."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # queued shortest first: batches pad less
        try:
            results = await asyncio.wait_for(self.batcher.submit_many([rows[i] for i in order]),
                                             self.cfg.request_timeout)
        except TimeoutError:
            raise Timeout(f"the request took longer than {self.cfg.request_timeout:g} s") from None
        ordered = [None] * len(rows)
        for i, result in zip(order, results):
            ordered[i] = result
        return ordered

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        rows = await asyncio.to_thread(self.rows, request)  # tokenizing a 2 MB body must not stall the loop
        vectors = await self.encode(rows)
        if request.dimensions is not None and request.dimensions < self.dim:
            vectors = [self._shorten(v, request.dimensions) for v in vectors]
        data = [Embedding(index=i, embedding=_encode(v, request.encoding_format)) for i, v in enumerate(vectors)]
        tokens = sum(map(len, rows))
        return EmbeddingResponse(data=data, model=self.model_id, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))


def _encode(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]
