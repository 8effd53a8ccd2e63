"""Hybrid search with Qdrant: a BGE-M3's three representations (a dense vector, a sparse one, one vector per
token), each text's from ONE /v1/encode call, indexed in one Qdrant collection; a query takes candidates by
dense and by sparse similarity (Qdrant's prefetch) and re-scores them by MaxSim on the token vectors.

    pip install qdrant-client
    python examples/hybrid_qdrant.py [--url http://127.0.0.1:8000] [--model bge-m3] [--texts 300] [--query TEXT ...]

The service must serve a BGE-M3 bundle (`python -m export BAAI/bge-m3 bundles/bge-m3`, then
`python -m service --bundle bge-m3=bundles/bge-m3`). Qdrant runs inside this script (qdrant-client's local
mode, in memory); the same calls work on a Qdrant server with QdrantClient(url=...). The texts are
generated (deterministic: the same run gives the same ids). Printed per query: the candidates each
retriever found alone, then the hybrid order with Qdrant's MaxSim score (the sum over the query's token
vectors of each one's best cosine with the document's: /v1/rerank's `scores.multivector` is its mean).
Fields and shapes: docs/representations.md.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import os
import random

import httpx
import numpy as np
from qdrant_client import QdrantClient, models

SUBJECTS = ["the red fox", "a small cat", "the old farmer", "my neighbour", "a young pilot", "the chef",
            "our teacher", "the museum guide"]
VERBS = ["paints", "repairs", "sells", "photographs", "cleans", "buys", "describes", "carries"]
OBJECTS = ["a wooden boat", "fresh bread", "the garden fence", "an old bicycle", "blue tiles", "a violin",
           "winter coats", "maps of the coast"]
PLACES = ["in Lisbon", "near the river", "every Sunday", "before dawn", "at the market", "in the rain",
          "for the festival", "on the island"]
QUERIES = ["who repairs an old bicycle near the river", "fresh bread at the market", "a violin on the island"]
CANDIDATES = 20  # each prefetch's size: the MaxSim re-score sees at most twice this many documents


def generated_texts(n: int) -> list[str]:
    """n distinct short sentences, the same ones on every run (id i is always the same text)."""
    sentences = [" ".join(parts) + "." for parts in itertools.product(SUBJECTS, VERBS, OBJECTS, PLACES)]
    return random.Random(0).sample(sentences, n)


def decode(vectors: dict) -> np.ndarray:
    """A multivector as the service sends it with encoding_format base64: little-endian float32, with its shape."""
    return np.frombuffer(base64.b64decode(vectors["data"]), dtype="<f4").reshape(vectors["shape"])


def encode(client: httpx.Client, model: str, texts: list[str], input_type: str) -> list[dict]:
    """Dense, sparse and token vectors of `texts` from one forward pass of the service."""
    r = client.post("/v1/encode", json={"model": model, "inputs": texts, "input_type": input_type,
                                        "embedding": True, "sparse": True, "multivector": True,
                                        "encoding_format": "base64"})
    if r.status_code != 200:
        raise SystemExit(f"/v1/encode {r.status_code}: {r.text}")
    return [{"dense": np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist(),
             "sparse": models.SparseVector(indices=item["sparse"]["indices"], values=item["sparse"]["values"]),
             "colbert": decode(item["multivector"]).tolist()} for item in r.json()["data"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--model", default="bge-m3", help="the served BGE-M3's name")
    p.add_argument("--texts", type=int, default=300, help="how many generated texts to index")
    p.add_argument("--batch", type=int, default=32, help="texts per /v1/encode call")
    p.add_argument("--top", type=int, default=10, help="results per query")
    p.add_argument("--query", action="append", help="a query (repeat for more); default: three examples")
    args = p.parse_args()
    token = os.environ.get("ENCODER_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    texts = generated_texts(args.texts)

    qdrant = QdrantClient(":memory:")
    with httpx.Client(base_url=args.url, headers=headers, timeout=120) as client:
        for start in range(0, len(texts), args.batch):
            batch = texts[start:start + args.batch]
            vectors = encode(client, args.model, batch, "document")
            if start == 0:  # the sizes come from the model: a named vector per representation
                qdrant.create_collection(
                    "hybrid",
                    vectors_config={
                        "dense": models.VectorParams(size=len(vectors[0]["dense"]), distance=models.Distance.COSINE),
                        "colbert": models.VectorParams(
                            size=len(vectors[0]["colbert"][0]), distance=models.Distance.COSINE,
                            multivector_config=models.MultiVectorConfig(
                                comparator=models.MultiVectorComparator.MAX_SIM)),
                    },
                    sparse_vectors_config={"sparse": models.SparseVectorParams()})
            qdrant.upsert("hybrid", points=[models.PointStruct(id=start + i, vector=v, payload={"text": text})
                                            for i, (v, text) in enumerate(zip(vectors, batch, strict=True))])
        print(f"indexed {len(texts)} texts: dense {len(vectors[0]['dense'])}, sparse, "
              f"colbert {len(vectors[0]['colbert'][0])} per token")

        queries = args.query or QUERIES
        for query, q in zip(queries, encode(client, args.model, queries, "query"), strict=True):
            print(f"query {query!r}")
            for using in ("dense", "sparse"):  # what each retriever finds alone: the hybrid's candidates
                found = qdrant.query_points("hybrid", query=q[using], using=using, limit=CANDIDATES).points
                print(f"  {using} {[p.id for p in found]}")
            # the candidates of both, re-scored by MaxSim on the token vectors
            hits = qdrant.query_points(
                "hybrid",
                prefetch=[models.Prefetch(query=q["dense"], using="dense", limit=CANDIDATES),
                          models.Prefetch(query=q["sparse"], using="sparse", limit=CANDIDATES)],
                query=q["colbert"], using="colbert", limit=args.top, with_payload=True).points
            for rank, hit in enumerate(hits, 1):
                print(f"  {rank}. id {hit.id} maxsim {hit.score:.4f}  {hit.payload['text']}")
            print(f"  hybrid {[hit.id for hit in hits]}")


if __name__ == "__main__":
    main()
