"""What the encoder attended to, and why two texts are similar, with plain HTTP (httpx).

    python examples/attention_similarity.py [--url http://127.0.0.1:8000]

/v1/attention at word level: for each word, the two words it draws most from by attention
rollout (Abnar & Zuidema 2020: every layer's attention, heads averaged, with the residual). /v1/similarity with explain: the
cosine of the two texts, split exactly into each word's contribution (they sum to the score).
Fields and definitions: docs/attention.md.
"""

from __future__ import annotations

import argparse
import os

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    args = p.parse_args()
    token = os.environ.get("ENCODER_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    with httpx.Client(base_url=args.url, headers=headers, timeout=60) as client:
        r = client.post("/v1/attention", json={"inputs": "Photosynthesis is unbelievable.", "level": "word", "top_k": 2})
        r.raise_for_status()
        item = r.json()["data"][0]
        units = [u["text"] for u in item["units"]]
        print("units", units)
        for unit, best in zip(units, item["top_k"]):
            print(f"  {unit:>16} attends to " + ", ".join(f"{units[j]} {w:.2f}" for j, w in best))

        pair = ["A man is eating food.", "A man is eating a piece of bread."]
        r = client.post("/v1/similarity", json={"pairs": [pair], "explain": True, "level": "word"})
        r.raise_for_status()
        scored = r.json()["data"][0]
        print(f"similarity {scored['score']:.4f}")
        for side in scored["texts"]:
            contributions = [(u["text"], u["contribution"]) for u in side["units"]]
            print(f"  sum of contributions {sum(c for _, c in contributions):.4f}; largest: "
                  + ", ".join(f"{t} {c:+.3f}" for t, c in sorted(contributions, key=lambda x: -x[1])[:3]))


if __name__ == "__main__":
    main()
