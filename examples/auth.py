"""Bearer-token access control, as a client sees it.

    ENCODER_API_TOKEN=change-me python -m service ...           # the service requires the token
    ENCODER_API_TOKEN=change-me python examples/auth.py [--url http://127.0.0.1:8000]

The inference routes (POST /v1/*, POST /v2/models/{name}/infer) need `Authorization: Bearer
<token>`; a missing or wrong one is a 401 JSON error before the body is read. Health, readiness,
model metadata and /info stay open. Prints the status of each of those cases.
"""

from __future__ import annotations

import argparse
import os

import httpx


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the service (with its route prefix, if any)")
    p.add_argument("--token", default=os.environ.get("ENCODER_API_TOKEN"), help="default: $ENCODER_API_TOKEN")
    args = p.parse_args()
    if not args.token:
        raise SystemExit("no token: set ENCODER_API_TOKEN or pass --token")

    body = {"inputs": "hello"}  # /v1/encode: the default model when `model` is left out
    with httpx.Client(base_url=args.url, timeout=60) as client:
        r = client.post("/v1/encode", json=body)
        print("without a token", r.status_code, r.json()["error"]["type"], r.headers.get("www-authenticate"))
        r = client.post("/v1/encode", json=body, headers={"Authorization": "Bearer wrong"})
        print("with a wrong token", r.status_code, r.json()["error"]["type"])
        r = client.post("/v1/encode", json=body, headers={"Authorization": f"Bearer {args.token}"})
        if r.status_code != 200:
            raise SystemExit(f"with the token {r.status_code}: {r.text}")
        print("with the token", r.status_code, "dimension", len(r.json()["data"][0]["embedding"]))
        print("readiness without a token", client.get("/v2/health/ready").status_code)


if __name__ == "__main__":
    main()
