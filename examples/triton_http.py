"""Embeddings through NVIDIA's `tritonclient.http`, unchanged (Open Inference Protocol v2).

    python examples/triton_http.py [--url http://127.0.0.1:8000] [--model all-MiniLM-L6-v2] [--json]

One BYTES input named `text`; outputs sentence_embedding [n, hidden], last_hidden_state
[n, T, hidden] and attention_mask [n, T] (attentions only when named: it is large). Tensors
travel in the binary tensor data extension by default, as JSON with --json.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tritonclient.http as httpclient


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--json", action="store_true", help="JSON tensors instead of binary ones")
    args = p.parse_args()

    token = os.environ.get("ENCODER_API_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else None
    client = httpclient.InferenceServerClient(url=args.url.removeprefix("http://"))
    print("server ready", client.is_server_ready(), "model ready", client.is_model_ready(args.model))
    metadata = client.get_model_metadata(args.model)
    print("inputs", [(i["name"], i["datatype"]) for i in metadata["inputs"]])

    texts = ["The cat sat on the mat.", "Grüße aus Köln"]
    text = httpclient.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_), binary_data=not args.json)
    wanted = [httpclient.InferRequestedOutput(name, binary_data=not args.json)
              for name in ("sentence_embedding", "attention_mask")]
    result = client.infer(args.model, inputs=[text], outputs=wanted, headers=headers)
    embeddings, mask = result.as_numpy("sentence_embedding"), result.as_numpy("attention_mask")
    print("sentence_embedding shape", list(embeddings.shape), "norms", [round(float(n), 4) for n in np.linalg.norm(embeddings, axis=1)])
    print("tokens per text", mask.sum(axis=1).tolist())


if __name__ == "__main__":
    main()
