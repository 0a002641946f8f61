"""Cross-encoder serving: pairs tokenized together, scored through the embeddings' batcher and workers, and
shaped for /v1/rerank, /rerank (Cohere/Jina as vLLM serves them, or TEI's) and /v1/score. No FastAPI here."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import cast

import numpy as np

from trtserve.engine_dir.kinds import ModelKind
from trtserve.server.embeddings import EmbeddingService
from trtserve.server.errors import BadRequest
from trtserve.server.protocol import (
    Document,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    TeiRank,
    Usage,
)


class ScoreService(EmbeddingService):
    """A cross-encoder engine: its logits are the head's (B, labels); a one-label model's score is the sigmoid
    of its logit unless raw scores are asked for."""

    kind = ModelKind.SCORER

    def __init__(self, cfg, metrics=None):
        super().__init__(cfg, metrics)
        self.labels = self.manifest.model.architecture.num_labels or 1

    def pairs(self, query_texts: list[str], documents: list[str], truncate: bool, field: str,
              query_field: str) -> list:
        """Each (query, document) as one row with its token types, one query for every document or one each; a
        pair over the engine's limit is a 400 naming the item, unless `truncate` cuts the document to fit (a
        query that leaves no room is a 400 naming it)."""
        from trtserve.runtime.text import Pair

        if self.labels != 1:
            raise BadRequest(f"`{self.model_id}` has {self.labels} labels; scoring pairs needs a one-label "
                             "cross-encoder", param="model")
        if not documents:
            raise BadRequest(f"`{field}` is empty: give at least one text", param=field)
        if any(not q for q in query_texts):
            raise BadRequest(f"`{query_field}` is an empty string", param=query_field)
        if any(not d for d in documents):
            raise BadRequest(f"`{field}` contains an empty string", param=field)
        self.check_queue(len(documents), field)
        special = self.tokenizer.num_special_tokens_to_add(True)
        queries = self.tokenizer.encode_batch(query_texts, add_special_tokens=False)
        docs = self.tokenizer.encode_batch(documents, add_special_tokens=False)
        rows = []
        for i, doc in enumerate(docs):
            query = queries[i if len(queries) > 1 else 0]
            room = self.max_seq - special - len(query.ids)
            if room < 1:
                raise BadRequest(f"`{query_field}` has {len(query.ids)} tokens: with the special tokens and at least "
                                 f"one token of each document it is over this engine's limit of {self.max_seq}",
                                 param=query_field, code="context_length_exceeded")
            if len(doc.ids) > room:
                if not truncate:
                    raise BadRequest(f"`{field}`[{i}] makes a pair of {len(query.ids) + len(doc.ids) + special} "
                                     f"tokens; this engine's limit is {self.max_seq} (`truncate`: true cuts the "
                                     "document)",
                                     param=field, code="context_length_exceeded")
                doc.truncate(room)
            pair = self.tokenizer.post_process(query, doc, True)
            rows.append(Pair(pair.ids, pair.type_ids))
        return rows

    async def scores(self, rows: list, raw: bool) -> np.ndarray:
        logits = np.array([np.asarray(r, np.float64) for r in await self.encode(rows)])[:, 0]
        return logits if raw else 1 / (1 + np.exp(-logits))

    async def rerank(self, request: RerankRequest):
        """RerankResponse for `documents`, TEI's list of ranks for `texts`."""
        if request.model is not None:
            self.check_model(request.model)
        if (request.documents is None) == (request.texts is None):
            raise BadRequest("give `documents` (Cohere/Jina) or `texts` (TEI), one of the two", param="documents")
        tei = request.texts is not None
        other = "return_documents" if tei else "return_text"  # each body's own way to echo the texts
        if other in request.model_fields_set:
            raise BadRequest(f"`{other}` belongs to the {'Cohere/Jina' if tei else 'TEI'} body; with `"
                             f"{'texts' if tei else 'documents'}` use `{'return_text' if tei else 'return_documents'}`",
                             param=other)
        documents = cast("list[str | Document]", request.documents)  # given where texts are not (checked above)
        texts = request.texts if tei else [d.text if isinstance(d, Document) else d for d in documents]
        assert texts is not None
        field = "texts" if tei else "documents"
        rows = await asyncio.to_thread(self.pairs, [request.query], texts, request.truncate, field, "query")
        scores = await self.scores(rows, raw=request.raw_scores)
        order = sorted(range(len(texts)), key=lambda i: -scores[i])[: request.top_n]
        if tei:
            return [TeiRank(index=i, score=float(scores[i]), text=texts[i] if request.return_text else None)
                    .model_dump(exclude_none=True) for i in order]
        results = [RerankResult(index=i, relevance_score=float(scores[i]),
                                document=Document(text=texts[i]) if request.return_documents else None) for i in order]
        return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=self.model_id, results=results,
                              usage=RerankUsage(total_tokens=sum(map(len, rows)))).model_dump(exclude_none=True)

    async def score(self, request: ScoreRequest) -> ScoreResponse:
        if request.model is not None:
            self.check_model(request.model)
        first = [request.text_1] if isinstance(request.text_1, str) else request.text_1
        second = [request.text_2] if isinstance(request.text_2, str) else request.text_2
        if len(first) not in (1, len(second)):
            raise BadRequest(f"`text_1` has {len(first)} texts and `text_2` {len(second)}: give one `text_1`, or as "
                             "many as `text_2`", param="text_1")
        rows = await asyncio.to_thread(self.pairs, first, second, request.truncate, "text_2", "text_1")
        scores = await self.scores(rows, raw=False)
        tokens = sum(map(len, rows))
        return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_id,
                             data=[ScoreData(index=i, score=float(s)) for i, s in enumerate(scores)],
                             usage=Usage(prompt_tokens=tokens, total_tokens=tokens))
