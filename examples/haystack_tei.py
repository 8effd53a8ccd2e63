"""A Haystack pipeline written for text-embeddings-inference, unchanged: only the URL points here.

    python examples/haystack_tei.py [--url http://127.0.0.1:8000]

Haystack's TEI embedders (package huggingface-api-haystack, since haystack-ai 3) embed documents into
an in-memory store, then a query, and the retriever ranks the documents by it. They ask for
normalize false, so the store's cosine does the normalising. The service's token (ENCODER_API_TOKEN)
goes as the embedders' token when access control is on.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HAYSTACK_TELEMETRY_ENABLED", "False")

from haystack import Document, Pipeline  # noqa: E402
from haystack.components.retrievers.in_memory import InMemoryEmbeddingRetriever  # noqa: E402
from haystack.document_stores.in_memory import InMemoryDocumentStore  # noqa: E402
from haystack.utils import Secret  # noqa: E402
from haystack_integrations.components.embedders.huggingface_api import (  # noqa: E402
    HuggingFaceAPIDocumentEmbedder, HuggingFaceAPITextEmbedder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    args = p.parse_args()
    token = os.environ.get("ENCODER_API_TOKEN")
    api = {"api_type": "text_embeddings_inference", "api_params": {"url": args.url.rstrip("/") + "/"},
           "token": Secret.from_token(token) if token else None}

    store = InMemoryDocumentStore(embedding_similarity_function="cosine")
    documents = [Document(content=t) for t in ["The museum is closed on Mondays.", "A man is eating a piece of bread.",
                                               "It will rain tomorrow."]]
    store.write_documents(HuggingFaceAPIDocumentEmbedder(**api, progress_bar=False).run(documents=documents)["documents"])
    query = Pipeline()
    query.add_component("embedder", HuggingFaceAPITextEmbedder(**api))
    query.add_component("retriever", InMemoryEmbeddingRetriever(document_store=store, top_k=3))
    query.connect("embedder.embedding", "retriever.query_embedding")
    found = query.run({"embedder": {"text": "What is the man eating?"}})["retriever"]["documents"]
    for document in found:
        print(f"retrieved {document.score:.4f} {document.content!r}")


if __name__ == "__main__":
    main()
