"""Request ids: the rule a client's id must pass (the same on every protocol), and the id of the call
this task serves, which error bodies and details carry."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

# what a client's id may be: 1-128 visible ASCII characters (Envoy's and nginx's ids are 32-36);
# anything else is replaced by one made here, never echoed into a header or a log line as it came
MAX_REQUEST_ID_CHARS = 128
_VALID = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_REQUEST_ID_CHARS)

# the id of the call this task serves: what error bodies carry (service/front/errors.py)
current_request_id: ContextVar[str | None] = ContextVar("request_id", default=None)


def is_valid_request_id(value: str | bytes) -> bool:
    """Whether a client's id may be used as the call's (the rule of every protocol): 1-128 visible
    ASCII characters."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return _VALID.fullmatch(value) is not None


def new_request_id() -> str:
    return uuid.uuid4().hex
