"""OpenAI's embeddings API, POST /v1/embeddings: works with the official `openai` client.

No `from __future__ import annotations` (see routes_native.py).
"""

import numpy as np
from fastapi import Request

from service.batching import EncodeJob, l2_normalize
from service.errors import InvalidRequest, NotFound
from service.http_app import ERROR_RESPONSES, app
from service.responses import JSONResponse, KindCounter, encode_array
from service.schemas import OpenAIEmbeddingRequest, OpenAIEmbeddingResponse


class OpenAIRoutes:
    @app.post("/v1/embeddings", response_model=OpenAIEmbeddingResponse, responses=ERROR_RESPONSES)
    async def embeddings(self, body: OpenAIEmbeddingRequest, request: Request) -> JSONResponse:
        """OpenAI's embeddings API: works with the official `openai` client."""
        if body.model is not None and body.model != self.name:
            raise NotFound(f"model {body.model!r} is not served here; this service serves {self.name!r}")
        if body.dimensions is not None and body.dimensions > self.model.hidden_size:
            raise InvalidRequest(f"dimensions {body.dimensions} exceeds the model's {self.model.hidden_size}")
        texts = self._texts(body.input)
        tokenized = await self._tokenize(texts, True, "/v1/embeddings")
        result = await self._infer(
            EncodeJob(route="/v1/embeddings", ids=[t.ids for t in tokenized], normalize=self.model.normalize), request
        )
        vectors = result.embeddings
        if body.dimensions is not None:  # shortened as OpenAI does: cut, then re-normalise
            vectors = np.ascontiguousarray(l2_normalize(vectors[:, : body.dimensions]).astype(np.float32))
        kinds = KindCounter()
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": kinds.fragment("embedding", encode_array(v, body.encoding_format, "float32")),
            }
            for i, v in enumerate(vectors)
        ]
        kinds.report(request)
        tokens = sum(t.n_tokens for t in tokenized)
        return JSONResponse(
            {"object": "list", "data": data, "model": self.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        )
