"""huggingface_hub's InferenceClient, as code written for text-embeddings-inference calls it: only the
URL changes (LangChain's HuggingFaceEndpointEmbeddings, Haystack's TEI embedders and others call it).

    python examples/tei_huggingface_hub.py [--url http://127.0.0.1:8000] [--reranker NAME]

With the URL as its model, the client posts to the URL itself: TEI's root route, which embeds with an
embedding model. Prints the embeddings' shape and norms (normalised, TEI's default, then not), the
cosine of the two texts, and, with --reranker (a served cross-encoder), TEI's /rerank of them. The
service's token (ENCODER_API_TOKEN) goes as the client's token when access control is on. Keep
HF_HUB_OFFLINE unset: huggingface_hub then refuses every URL, a local one included.
"""

from __future__ import annotations

import argparse
import os

import httpx
import numpy as np
from huggingface_hub import InferenceClient


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--reranker", default=None, help="a served cross-encoder: also rerank through TEI's /rerank")
    args = p.parse_args()
    token = os.environ.get("ENCODER_API_TOKEN")
    url = args.url.rstrip("/") + "/"

    client = InferenceClient(model=url, token=token)
    texts = ["A man is eating food.", "A man is eating a piece of bread."]
    vectors = client.feature_extraction(texts)
    print(f"feature_extraction shape {list(vectors.shape)} norms {[round(float(n), 4) for n in np.linalg.norm(vectors, axis=1)]}")
    raw = client.feature_extraction(texts, normalize=False)
    print(f"normalize=False norms {[round(float(n), 2) for n in np.linalg.norm(raw, axis=1)]}")
    print(f"cosine {float(vectors[0] @ vectors[1]):.4f}")
    if args.reranker:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        ranked = httpx.post(url + "rerank", json={"model": args.reranker, "query": "what is the man eating?",
                                                  "texts": texts, "return_text": True}, headers=headers, timeout=60)
        ranked.raise_for_status()
        for item in ranked.json():
            print(f"rerank index {item['index']} score {item['score']:.4f} {item['text']!r}")


if __name__ == "__main__":
    main()
