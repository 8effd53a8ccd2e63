"""Rank documents against a query with a served cross-encoder (POST /v1/rerank).

    python examples/rerank.py [--url http://127.0.0.1:8000] [--model ranker] [--top-n N]

The service must serve a sequence-classification bundle with one label (a cross-encoder), e.g.
`python -m service --bundle bundles/all-MiniLM-L6-v2 --bundle ranker=bundles/my-cross-encoder`.
relevance_score is what sentence-transformers' CrossEncoder.predict gives (the logit through the
activation saved with the model: a sigmoid unless it saved another, as MS MARCO models save Identity);
results come best first, each with its document's index. Details: docs/heads.md.
"""

from __future__ import annotations

import argparse
import os

import httpx

QUERY = "how do I reset my password"
DOCUMENTS = ["click forgot password on the sign in page", "the museum is closed on mondays",
             "reset it from the account settings page", "rain tomorrow"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--model", default="ranker", help="the served cross-encoder's name")
    p.add_argument("--top-n", type=int, default=None)
    args = p.parse_args()
    token = os.environ.get("ENCODER_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    body = {"model": args.model, "query": QUERY, "documents": DOCUMENTS, "return_documents": True}
    if args.top_n:
        body["top_n"] = args.top_n
    r = httpx.post(args.url.rstrip("/") + "/v1/rerank", json=body, headers=headers, timeout=120)
    if r.status_code != 200:
        raise SystemExit(f"{r.status_code}: {r.text}")
    results = r.json()["results"]
    print(f"query {QUERY!r}")
    for rank, res in enumerate(results, 1):
        print(f"{rank}. index {res['index']} score {res['relevance_score']:.4f}  {res['document']['text']}")
    print("order", [res["index"] for res in results])


if __name__ == "__main__":
    main()
