"""Embeddings through the official `openai` client, unchanged: only base_url points here.

    python examples/openai_client.py [--url http://127.0.0.1:8000] [--model NAME]

The API key is sent as `Authorization: Bearer <key>`: the service's token when access control is on
(ENCODER_API_TOKEN), anything when it is off. Prints the served models, each vector's dimension and
the cosine of the two texts (the vectors come back L2-normalised, so it is their dot product).
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--model", default=None, help="served model name (default: the first listed)")
    args = p.parse_args()

    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=os.environ.get("ENCODER_API_TOKEN", "unused"))
    models = [m.id for m in client.models.list()]
    print("models", ", ".join(models))
    model = args.model or models[0]
    texts = ["A man is eating food.", "A man is eating a piece of bread."]
    result = client.embeddings.create(model=model, input=texts)
    vectors = [d.embedding for d in result.data]
    for text, vector in zip(texts, vectors):
        print(f"dimension {len(vector)}  {text!r}")
    print(f"cosine {sum(a * b for a, b in zip(*vectors)):.4f}")
    print(f"usage prompt_tokens {result.usage.prompt_tokens}")


if __name__ == "__main__":
    main()
