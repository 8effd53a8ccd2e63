"""LlamaIndex's text-embeddings-inference classes, unchanged: only base_url points here.

    python examples/llama_index_tei.py [--url http://127.0.0.1:8000] [--reranker NAME]

TextEmbeddingsInference posts to /embed; with --reranker (a served cross-encoder first among the
service's classifiers: TEI's routes take the first model of their task), the TEI rerank postprocessor
posts to /rerank and orders three nodes. The service's token (ENCODER_API_TOKEN) is passed where each
class takes one when access control is on.
"""

from __future__ import annotations

import argparse
import os

from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference
from llama_index.postprocessor.tei_rerank import TextEmbeddingInference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--reranker", action="store_true", help="also rerank (the first served classifier)")
    args = p.parse_args()
    token = os.environ.get("ENCODER_API_TOKEN")
    url = args.url.rstrip("/")

    embedder = TextEmbeddingsInference(base_url=url, model_name="all-MiniLM-L6-v2", auth_token=token)
    vectors = embedder.get_text_embedding_batch(["A man is eating food.", "A man is eating a piece of bread."])
    print(f"embeddings {len(vectors)} dimension {len(vectors[0])}")
    print(f"cosine {sum(a * b for a, b in zip(*vectors)):.4f}")
    if args.reranker:
        # this class sends its token as the whole Authorization header, without "Bearer "
        reranker = TextEmbeddingInference(base_url=url, top_n=3, auth_token=f"Bearer {token}" if token else None)
        nodes = [NodeWithScore(node=TextNode(text=t)) for t in
                 ["the museum is closed", "he is eating bread", "a man eats food"]]
        for node in reranker.postprocess_nodes(nodes, query_bundle=QueryBundle("what is the man eating?")):
            print(f"rerank score {node.score:.4f} {node.node.text!r}")


if __name__ == "__main__":
    main()
