"""Embeddings through NVIDIA's `tritonclient.grpc`, unchanged (KServe v2 over gRPC).

    python examples/triton_grpc.py [--target 127.0.0.1:9000] [--model all-MiniLM-L6-v2] [--application encoder]

The same model, input and outputs as v2 over HTTP (examples/triton_http.py): one BYTES input named
`text`; sentence_embedding, last_hidden_state, attention_mask (and attentions when named), as raw
tensors. Errors are gRPC status codes; the token, when the service requires one, goes in the
`authorization` metadata. With several Serve applications on one cluster, name yours in the
`application` metadata (--application).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="127.0.0.1:9000", help="HOST:PORT of the gRPC ingress")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--application", help="the Serve application, where a cluster runs several")
    args = p.parse_args()

    headers = {"application": args.application} if args.application else {}
    if token := os.environ.get("ENCODER_API_TOKEN"):
        headers["authorization"] = f"Bearer {token}"
    client = grpcclient.InferenceServerClient(url=args.target)
    print("server ready", client.is_server_ready(headers=headers), "model ready",
          client.is_model_ready(args.model, headers=headers))
    metadata = client.get_model_metadata(args.model, headers=headers)
    print("outputs", [(o.name, o.datatype, list(o.shape)) for o in metadata.outputs])

    texts = ["The cat sat on the mat.", "Grüße aus Köln"]
    text = grpcclient.InferInput("text", [len(texts)], "BYTES")
    text.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    wanted = [grpcclient.InferRequestedOutput(name) for name in ("sentence_embedding", "attention_mask")]
    # a gRPC deadline (client_timeout) is the request's deadline on the server too
    result = client.infer(args.model, inputs=[text], outputs=wanted, headers=headers, request_id="example-1",
                          client_timeout=30)
    embeddings, mask = result.as_numpy("sentence_embedding"), result.as_numpy("attention_mask")
    print("sentence_embedding shape", list(embeddings.shape),
          "norms", [round(float(n), 4) for n in np.linalg.norm(embeddings, axis=1)])
    print("tokens per text", mask.sum(axis=1).tolist(), "id", result.get_response().id)
    print("cosine", round(float(embeddings[0] @ embeddings[1]), 4))
    try:
        client.infer("no-such-model", inputs=[text], headers=headers)
    except InferenceServerException as exc:
        print("unknown model ->", exc.status())
    client.close()


if __name__ == "__main__":
    main()
