"""The typed record of one call, and the one deadline rule.

A transport makes the Call when the call arrives (service/http/middleware.py from the ASGI scope,
service/grpc/servicer.py from the gRPC context); the API fills in what it learns (model, task, texts,
tokens, bytes by kind, why it failed); service/front/finish.py records it when the call ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.errors import Forbidden, InvalidRequest

if TYPE_CHECKING:
    from service.engine.engine import Engine
    from service.front.keys import ApiKey
    from service.front.quotas import Window
    from service.engine.runner import EncodeJob
    from service.front.policy import RoutePolicy

# How much earlier than the client's deadline ours ends: the client's clock (Serve's for
# X-Request-Timeout-Seconds, gRPC's for a call's deadline) starts a little before ours, so ours ends
# first and the answer is ours.
DEADLINE_MARGIN_S = 0.05


@dataclass
class Call:
    """One call in progress: what its gate, deadline, metrics, access log line and span need."""

    id: str
    protocol: str  # http or grpc: the metrics' protocol label
    method: str  # the HTTP method, or `gRPC`
    path: str = ""  # the path asked for (in the app), or a gRPC call's full name
    route: str = "unmatched"  # the route template (label values stay few), or a gRPC call's full name
    policy: RoutePolicy | None = None  # what the route's API declared (service/front/policy.py)
    arrived: float = field(default_factory=time.perf_counter)
    asked_deadline_s: float | None = None  # the client's own deadline, seconds from arrival (NaN: unreadable)
    deadline_name: str = "the client's deadline"  # how the client set it (a header's name), for its error
    deadline_text: str | None = None  # the client's deadline as it was sent, for the same error
    model: str = ""  # the served model the call is for, once known
    task: str = ""  # and that model's task: embedding, classification
    texts: int = 0  # texts and tokens that reached inference
    tokens: int = 0
    response_kinds: dict[str, int] = field(default_factory=dict)  # response bytes by output kind
    failure_reason: str | None = None  # why it failed, when it did (an error type)
    timed_out: bool = False  # cancelled because its deadline passed
    client_gone: bool = False  # cancelled because the client went away
    engine: Engine | None = None  # the model it holds a lease on (a model with leases is never unloaded)
    key: ApiKey | None = None  # whose call it is (the keys file's, or the single token's); None: auth off
    limits: dict[str, Window] = field(default_factory=dict)  # a limited key's windows after it (front/quotas.py)
    lease: str | None = None  # a limited key's concurrent lease, given back when the call ends
    asked_batch: bool = False  # the caller asked to go behind interactive work (x-encoder-priority: batch)

    @property
    def priority(self) -> str:
        """Its class in the batch queue: `batch` for a batch-class key's call or one that asked for it, else
        `interactive` (engine/batcher.py)."""
        return "batch" if self.asked_batch or (self.key is not None and self.key.priority == "batch") \
            else "interactive"

    def may_call(self, model: str | None) -> None:
        """Forbidden (403) when the call's key may not call `model` (the keys file's `models`)."""
        if model and self.key is not None and not self.key.may_call(model):
            from service.engine.engine import shown

            raise Forbidden(f"the key {self.key.name!r} may not call model {shown(model)} (the keys file's `models` "
                            "for it)")

    def serves(self, engine: Engine) -> Engine:
        """Note the model the call is for (the metrics' model and task labels), and hold it loaded until the
        call ends (`release`, at its record: front/finish.py); returns it."""
        self.may_call(engine.name)
        self.model, self.task = engine.name, engine.model.task
        if self.engine is not engine:
            self.release()
            engine.leases += 1
            self.engine = engine
        return engine

    def release(self) -> None:
        """The call no longer needs its model loaded."""
        if self.engine is not None:
            self.engine.leases -= 1
            self.engine = None

    @staticmethod
    def tokens_of(jobs: list[EncodeJob]) -> int:
        """The tokens `jobs` send to inference: what a key's tokens per minute counts (front/quotas.py)."""
        return sum(len(ids) for job in jobs for ids in job.ids)

    def count(self, jobs: list[EncodeJob]) -> None:
        """Texts and tokens the call sends to inference, for its access log line and span; and its priority
        on each job (the batch queue's order: engine/batcher.py)."""
        for job in jobs:
            job.priority = self.priority
        self.texts += sum(len(job.ids) for job in jobs)
        self.tokens += self.tokens_of(jobs)

    def failed(self, reason: str) -> None:
        """Why the call failed, unless a reason was already given (the first is the cause)."""
        if self.failure_reason is None:
            self.failure_reason = reason

    # ---- the one deadline rule ----

    def seconds_left(self, limit_s: float, now: float | None = None) -> float:
        """Seconds the call has left (negative once past): the service's limit, or the client's own
        deadline less the margin when that is shorter, counted from arrival, so the time spent reading,
        parsing and tokenizing it counts."""
        asked = self.asked_deadline_s
        if asked is not None and (not asked > 0 or asked == float("inf")):
            raise InvalidRequest(f"{self.deadline_name} must be a positive number of seconds, "
                                 f"got {self.deadline_text if self.deadline_text is not None else asked!r}")
        allowed = limit_s if asked is None else min(asked - DEADLINE_MARGIN_S, limit_s)
        return allowed - ((time.perf_counter() if now is None else now) - self.arrived)

    def deadline(self, limit_s: float) -> float:
        """The timeout a job of this call may wait for (at least a millisecond)."""
        return max(self.seconds_left(limit_s), 0.001)

    def past_client_deadline(self, now: float | None = None) -> bool:
        """Whether the client's own deadline had passed by `now`: a cancellation then is the deadline's
        doing (a timeout), not the client's leaving."""
        asked = self.asked_deadline_s
        if asked is None or not asked > 0:
            return False
        return (time.perf_counter() if now is None else now) - self.arrived >= asked - DEADLINE_MARGIN_S
