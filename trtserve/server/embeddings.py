"""Embedding serving logic: validation, tokenization, batching, response shapes. No FastAPI here."""

from __future__ import annotations

import asyncio
import base64
import logging

import numpy as np

from trtserve.server.config import ServerConfig
from trtserve.server.errors import BadRequest, Timeout
from trtserve.server.protocol import Embedding, EmbeddingRequest, EmbeddingResponse, Usage
from trtserve.server.scheduler import DynamicBatcher
from trtserve.server.service import Service

log = logging.getLogger("trtserve.server")


class EmbeddingService(Service):
    """Validation and tokenization here; the backend runs in the workers, fed by one batcher."""

    kind = "encoder"  # make_service gives decoder engines to GenerationService

    def __init__(self, cfg: ServerConfig, metrics=None):
        super().__init__(cfg, metrics)  # every worker verifies the engine's files
        architecture = self.manifest.model.architecture
        self.dim, self.vocab = architecture.hidden_size, architecture.vocab_size
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
        if request.dimensions is not None and request.dimensions != self.dim:
            raise BadRequest(f"`{self.model_id}` returns {self.dim} dimensions and cannot shorten them; "
                             f"omit `dimensions` or set it to {self.dim}", param="dimensions")
        items = request.input
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
        if rows:
            if any(not r for r in rows) or any(not 0 <= t < self.vocab for r in rows for t in r):
                raise BadRequest(f"token arrays must be non-empty with ids in [0, {self.vocab})", param="input")
        else:
            rows = self.tokenize(texts)
        if len(rows) > self.cfg.max_queue:
            raise BadRequest(f"`input` has {len(rows)} items; this server queues at most {self.cfg.max_queue} "
                             "(--max-queue): split the request", param="input")
        longest = max(map(len, rows))
        if longest > self.max_seq:
            raise BadRequest(f"an input has {longest} tokens; this engine's limit is {self.max_seq} tokens",
                             param="input", code="context_length_exceeded")
        return rows

    async def encode(self, rows: list[list[int]]) -> list:
        """Each row's result from the batcher (TextEngine.encode_ids), in order, within the request timeout."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))  # queued shortest first: batches pad less
        try:
            results = await asyncio.wait_for(self.batcher.submit_many([rows[i] for i in order]),
                                             self.cfg.request_timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"the request took longer than {self.cfg.request_timeout:g} s") from None
        ordered = [None] * len(rows)
        for i, result in zip(order, results):
            ordered[i] = result
        return ordered

    async def embed(self, request: EmbeddingRequest) -> EmbeddingResponse:
        rows = await asyncio.to_thread(self.rows, request)  # tokenizing a 2 MB body must not stall the loop
        vectors = await self.encode(rows)
        data = [Embedding(index=i, embedding=_encode(v, request.encoding_format)) for i, v in enumerate(vectors)]
        tokens = sum(map(len, rows))
        return EmbeddingResponse(data=data, model=self.model_id, usage=Usage(prompt_tokens=tokens, total_tokens=tokens))


def _encode(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return [float(x) for x in vector]
