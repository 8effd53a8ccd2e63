"""The official `cohere` SDK's ClientV2, unchanged: only base_url points here.

    python examples/cohere_client.py [--url http://127.0.0.1:8000] [--model NAME] [--reranker NAME]

Embeds two texts as float and as ubinary (one bit per dimension, 48 bytes for 384 dimensions), and with
--reranker (a served cross-encoder) reranks them. Cohere's model names (`embed-v4.0`, `rerank-v3.5`)
reach a served model through its bundle's `aliases` setting (docs/serving.md#cohere-api-v2); here the
served names are used. The api key is the service's token (ENCODER_API_TOKEN) when access control is
on, anything when it is off.
"""

from __future__ import annotations

import argparse
import os

import cohere


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="a served embedding model, or an alias of one")
    p.add_argument("--reranker", default=None, help="a served cross-encoder: also rerank")
    args = p.parse_args()

    client = cohere.ClientV2(base_url=args.url, api_key=os.environ.get("ENCODER_API_TOKEN", "unused"))
    texts = ["A man is eating food.", "The museum is closed on Mondays."]
    r = client.embed(texts=texts, model=args.model, input_type="search_document", embedding_types=["float", "ubinary"])
    print(f"float dimension {len(r.embeddings.float_[0])} ubinary bytes {len(r.embeddings.ubinary[0])}")
    print(f"id {r.id} input_tokens {r.meta.billed_units.input_tokens:.0f}")
    if args.reranker:
        ranked = client.rerank(model=args.reranker, query="what is the man eating?", documents=texts, top_n=2)
        for result in ranked.results:
            print(f"rerank index {result.index} relevance_score {result.relevance_score:.4f}")


if __name__ == "__main__":
    main()
