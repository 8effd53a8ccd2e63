"""The gate every call passes, on every protocol: the bearer key of the routes an API declared inference
routes (the single token's, or a keys file's: service/front/keys.py), and the counters of calls inside this
replica.

The token and the counters are class attributes, set by the deployment when a replica starts: Ray
Serve pickles the ingress's FastAPI app by value, module variables its functions read included, while
this class is imported by reference, so every reader in the replica sees the same values.
"""

from __future__ import annotations

import os

from service.config import ServiceSettings
from service.engine.errors import Unauthorized
from service.front.keys import INTERNAL_KEY_NAME, ApiKey, Keyring


class Gate:
    """Who may call, and how many calls are inside this replica."""

    token: bytes | None = None  # the single token (ENCODER_API_TOKEN, auth_token_file), if any
    keyring: Keyring | None = None  # every key (the keys file's and the token's); None: authentication off
    in_flight = 0  # calls inside this replica's transports now
    pending = 0  # inference calls admitted and not yet answered (waiting for a batch or in one)
    admitted = 0  # inference calls admitted since the replica started

    @classmethod
    def identify(cls, authorization: str | bytes | None,
                 on_behalf_of: bytes | None = None) -> tuple[ApiKey | None, Unauthorized | None]:
        """The key of a call whose `authorization` (HTTP header, gRPC metadata) carries a bearer secret, or its
        refusal; (None, None) when authentication is off. The Batch API runner's own key, with `on_behalf_of`
        (keys.ON_BEHALF_HEADER: any other key's is ignored), runs as the key that owns the batch
        (Keyring.batch_work_of), refused once that key has left the keys file."""
        keyring = cls.keyring
        if keyring is None:
            return None, None
        raw = authorization.encode("latin-1") if isinstance(authorization, str) else (authorization or b"")
        scheme, _, provided = raw.partition(b" ")
        if scheme.lower() == b"bearer" and provided.strip():
            key = keyring.identify(provided.strip())
            if key is not None and on_behalf_of and key.name == INTERNAL_KEY_NAME:
                name = on_behalf_of.decode("latin-1")
                owner = keyring.batch_work_of(name)
                if owner is None:
                    return None, Unauthorized(f"the key {name!r} that owns this batch is no longer in the keys file")
                return owner, None
            if key is not None:
                return key, None
        return None, Unauthorized("missing or invalid bearer token")

    @classmethod
    def refusal(cls, authorization: str | bytes | None) -> Unauthorized | None:
        """The refusal of an inference call whose `authorization` carries no known key; None when it may go on."""
        return cls.identify(authorization)[1]

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
        cls.keyring = Keyring.load(settings.keys_file, cls.token) \
            if cls.token is not None or settings.keys_file is not None else None


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
