"""The gate every call passes, on every protocol: the bearer token of the routes an API declared
inference routes, and the counters of calls inside this replica.

The token and the counters are class attributes, set by the deployment when a replica starts: Ray
Serve pickles the ingress's FastAPI app by value, module variables its functions read included, while
this class is imported by reference, so every reader in the replica sees the same values.
"""

from __future__ import annotations

import hmac
import os

from service.config import ServiceSettings
from service.engine.errors import Unauthorized


class Gate:
    """Who may call, and how many calls are inside this replica."""

    token: bytes | None = None  # None: authentication off
    in_flight = 0  # calls inside this replica's transports now
    pending = 0  # inference calls admitted and not yet answered (waiting for a batch or in one)
    admitted = 0  # inference calls admitted since the replica started

    @classmethod
    def refusal(cls, authorization: str | bytes | None) -> Unauthorized | None:
        """The refusal of an inference call whose `authorization` (HTTP header, gRPC metadata) lacks the
        bearer token, compared in constant time; None when it may go on (or authentication is off)."""
        token = cls.token
        if token is None:
            return None
        raw = authorization.encode("latin-1") if isinstance(authorization, str) else (authorization or b"")
        scheme, _, provided = raw.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(provided.strip(), token):
            return None
        return Unauthorized("missing or invalid bearer token")

    @classmethod
    def enter(cls, inference: bool) -> None:
        cls.in_flight += 1
        if inference:
            cls.pending += 1
            cls.admitted += 1

    @classmethod
    def leave(cls, inference: bool) -> None:
        cls.in_flight -= 1
        if inference:
            cls.pending -= 1

    @classmethod
    def configure(cls, settings: ServiceSettings) -> None:
        cls.token = load_token(settings)


def load_token(settings: ServiceSettings) -> bytes | None:
    """The API token: from the file named in the settings (a mounted secret), else from the
    environment variable named in the settings; None when neither is set (authentication off)."""
    if settings.auth_token_file is not None:
        token = settings.auth_token_file.read_text().strip()
        if not token:
            raise ValueError(f"{settings.auth_token_file}: the token file is empty")
        return token.encode()
    value = os.environ.get(settings.auth_token_env, "").strip()
    return value.encode() if value else None
