"""On how many replicas each model of the repository is held (issue 57's `min_loaded` and `max_loaded`).

One small Ray actor per application, the board, hears from every replica what it holds (each second, and
whenever that changes) and answers what the others hold. A replica then:

- keeps a model with `min_loaded: k` loaded when it is one of the k live replicas ranked first for that model
  (rendezvous hashing of the model's and the replicas' names: every replica ranks alike, and a replica that
  comes or goes moves only the models it ranked for);
- asks the board before it loads a model with `max_loaded: m`: the board refuses while m other live replicas
  hold it, and the request is answered 503 with Retry-After (the ingress sends its next requests to the
  replica that holds it). The refusal is noted as wanted: a replica holding that model at its bound gives it
  up once idle there, so a replica to which every request for it is routed is not refused for ever;
- forgets a replica not heard from for STALE_S (it died or stopped): what it held no longer counts.

The board is a preference, not a lock: when it cannot be reached a load goes ahead (each replica's memory is
still bounded by its own budget), and a board restarted empty is filled again by the next reports.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from typing import Any

from service.config import ModelPlacement

logger = logging.getLogger("ray.serve")

STALE_S = 5.0  # a replica silent this long is gone (each reports every second)
# A load the board let through counts as held this long, or until the replica's report lists it: a report whose
# list was made while the claim was on its way would otherwise drop it, and let a second replica through
CLAIM_S = 10.0
BOARD_CALL_S = 2.0  # the longest a replica waits for the board before going on without it (well within STALE_S)
BOARD_START_S = 10.0  # ... until the board first answered: it starts in seconds
NAMESPACE = "serve"


def board_name(app: str) -> str:
    """The board's actor name: one per application (service/deployment.py kills it when the app is deleted)."""
    return f"encoder-placement-{app}"


class Board:
    """What each live replica holds, and which replicas were refused a model at its max_loaded lately."""

    def __init__(self) -> None:
        self.heard: dict[str, float] = {}  # replica -> when it last reported
        self.holds: dict[str, set[str]] = {}  # replica -> models held or loading there, as it last reported
        self.claims: dict[str, dict[str, float]] = {}  # replica -> {model it was let load: when}
        self.wanted: dict[str, dict[str, float]] = {}  # model -> {replica refused it: when}

    def _forget_stale(self, now: float) -> None:
        for replica in [r for r, t in self.heard.items() if now - t > STALE_S]:
            del self.heard[replica]
            self.holds.pop(replica, None)
            self.claims.pop(replica, None)
        for claims in self.claims.values():
            for model in [m for m, t in claims.items() if now - t > CLAIM_S]:
                del claims[model]
        for model, asked in list(self.wanted.items()):
            for replica in [r for r, t in asked.items() if now - t > STALE_S]:
                del asked[replica]
            if not asked:
                del self.wanted[model]

    def report(self, replica: str, held: list[str]) -> dict:
        """`replica` holds `held` now; the board's view, for it to rank and give way by."""
        now = time.monotonic()
        self.heard[replica] = now
        self.holds[replica] = set(held)
        for model in held:  # its claim is a holding now
            self.claims.get(replica, {}).pop(model, None)
        self._forget_stale(now)
        holders: dict[str, list[str]] = {}
        for r in sorted(self.heard):
            for m in self._holding(r):
                holders.setdefault(m, []).append(r)
        return {"replicas": sorted(self.heard), "holders": holders,
                "wanted": {m: sorted(asked) for m, asked in self.wanted.items()}}

    def claim(self, replica: str, model: str, max_loaded: int) -> bool:
        """Whether `replica` may load `model`: fewer than `max_loaded` other live replicas hold it. Held by it
        from now (its load), so that two replicas asking at once are not both let through."""
        now = time.monotonic()
        self._forget_stale(now)
        others = sum(1 for r in self.heard if r != replica and model in self._holding(r))
        if others >= max_loaded:
            self.wanted.setdefault(model, {})[replica] = now
            return False
        self.heard[replica] = now
        self.claims.setdefault(replica, {})[model] = now
        self.wanted.get(model, {}).pop(replica, None)
        return True

    def _holding(self, replica: str) -> set[str]:
        return self.holds.get(replica, set()) | self.claims.get(replica, {}).keys()


def rank(model: str, replicas: list[str]) -> list[str]:
    """The replicas in the order that keeps `model` (rendezvous hashing: the same order on every replica)."""
    return sorted(replicas, key=lambda r: hashlib.sha256(f"{model}\0{r}".encode()).digest())


class Placement:
    """A replica's side of the board: what it must keep, whether it may load, what it should give up."""

    def __init__(self, app: str, replica: str, models: dict[str, ModelPlacement]) -> None:
        import ray

        self.replica, self.models = replica, models
        self.view: dict = {"replicas": [replica], "holders": {}, "wanted": {}}
        self.board = ray.remote(Board).options(
            name=board_name(app), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
            num_cpus=0, max_restarts=-1).remote()
        self._unreachable = False
        self._answered = False

    async def _call(self, ref: Any) -> Any:
        result = await asyncio.wait_for(asyncio.wrap_future(ref.future()),
                                        BOARD_CALL_S if self._answered else BOARD_START_S)
        self._answered = True
        return result

    def _reached(self, ok: bool, what: str, exc: BaseException | None = None) -> None:
        if not ok and not self._unreachable:
            logger.warning("model placement board unreachable (%s: %s): loads go ahead without max_loaded", what,
                           exc)
        elif ok and self._unreachable:
            logger.info("model placement board reached again")
        self._unreachable = not ok

    async def report(self, held: list[str]) -> None:
        try:
            self.view = await self._call(self.board.report.remote(self.replica, held))
            self._reached(True, "report")
        except Exception as exc:  # the view stays as it was; loads go ahead
            self._reached(False, "report", exc)

    async def may_load(self, model: str) -> bool:
        """False while `model` is held by its max_loaded other replicas (True without a bound, or no board)."""
        bound = self.models.get(model)
        if bound is None or bound.max_loaded is None:
            return True
        try:
            allowed = await self._call(self.board.claim.remote(self.replica, model, bound.max_loaded))
            self._reached(True, "claim")
            return allowed
        except Exception as exc:
            self._reached(False, "claim", exc)
            return True

    def max_loaded(self, model: str) -> int | None:
        bound = self.models.get(model)
        return None if bound is None else bound.max_loaded

    def keep(self) -> set[str]:
        """The models with a min_loaded that this replica is one of the first min_loaded live replicas for."""
        live = sorted(set(self.view["replicas"]) | {self.replica})
        return {name for name, p in self.models.items()
                if p.min_loaded > 0 and self.replica in rank(name, live)[:p.min_loaded]}

    def give_way(self) -> set[str]:
        """Models at their max_loaded that another replica was refused lately: given up here once idle (unless
        kept here for min_loaded), so that the replica their requests are routed to may load them."""
        holders, wanted = self.view["holders"], self.view["wanted"]
        return {m for m, asked in wanted.items() if self.replica in holders.get(m, ())
                and any(r != self.replica for r in asked)
                and len(holders.get(m, ())) >= (self.max_loaded(m) or len(holders.get(m, ())) + 1)}
