"""The images' HEALTHCHECK: is the service alive, and what does it run on, in one line.

    python -m service.healthcheck [--url http://127.0.0.1:8000]

Exit 0 when /v2/health/live answers 200 (liveness only: a replica that is still loading is not a
reason to restart the container), else 1. The line says the replica's provider, and why it is not
CUDA where it is not (the CUDA image on a node without a GPU: "CUDA not used: no GPU visible: ..."), so that
`podman inspect`'s health log and `docker ps` tell an operator what a pod is really using.
Standard library only: it runs every 30 s.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def get(url: str, timeout: float) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def provider_line(info: dict) -> str:
    """'on CUDAExecutionProvider', or the CPU and why not CUDA ('no GPU visible: ...' on a node without
    one), from /info (its default model's, at the top level)."""
    provider, note = info.get("provider") or "?", info.get("provider_note") or ""
    return f"on {provider}" + (f" (CUDA not used: {note})" if note else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.healthcheck", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL")
    parser.add_argument("--timeout", type=float, default=4.0, help="seconds per request")
    args = parser.parse_args(argv)
    try:
        status, _ = get(f"{args.url}/v2/health/live", args.timeout)
    except (OSError, urllib.error.URLError) as exc:
        print(f"not live: {args.url} does not answer ({exc})")
        return 1
    if status != 200:
        print(f"not live: /v2/health/live answered {status}")
        return 1
    try:  # what it runs on; not part of the verdict (a loading replica has no /info yet)
        status, body = get(f"{args.url}/info", args.timeout)
        detail = provider_line(json.loads(body)) if status == 200 else f"/info answered {status}"
    except (OSError, ValueError, urllib.error.URLError) as exc:
        detail = f"/info did not answer ({exc})"
    print(f"live; serving {detail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
