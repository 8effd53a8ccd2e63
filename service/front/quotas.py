"""Each key's limits (issue 58; docs/access.md), counted for the whole service, not per replica.

- Requests and tokens per minute: `limits`' sliding-window counter, on one store every replica shares:
  Redis (`rate_limit_storage: redis://HOST:PORT`, for a cluster or several) or, by default, the memory of
  one small Ray actor per application (`memory://`: every replica of every node reaches it through Ray).
- Concurrent requests: a lease per request with a deadline (a replica that dies with a request in flight
  frees its lease when the deadline passes), in the same store.

A request of a limited key is admitted here before its body is read (its lease, its request counted, its
tokens' window looked at) and its tokens are counted once tokenized, before they are batched
(`charge_tokens`). Past a limit: RateLimited, a 429 whose type is the limit (`requests`, `tokens`,
`concurrent`), with Retry-After; each answer of a limited key carries OpenAI's x-ratelimit-* headers
(`headers`). A store that cannot be reached within STORE_CALL_S refuses limited keys' requests with 503
(`rate_limit_unreachable: closed`, the default) or lets them through uncounted (`open`), saying so in the
log once a minute. Keys without limits never touch the store.

A busy key is not one store call per request: each replica takes a share of the key's requests and tokens from
the store at once (what it spends in SHARE_S at its recent rate, at most 1/SHARE_OF_REST of what the key has
left, so that near a limit every request asks the store and the count stays exact) and spends it locally
(`Share`; requests that find it empty while a store call renews it wait for that call), and keeps the
concurrent leases its finished requests held for the key's next ones while the store has room (`LeasePool`).
What a replica took and did not spend stays counted: a key may be refused a little early, never let past a limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from service.engine.errors import NotReady, ServiceError

if TYPE_CHECKING:
    from service.config import ServiceSettings
    from service.front.call import Call
    from service.front.keys import ApiKey

logger = logging.getLogger("ray.serve")

STORE_CALL_S = 1.0  # the longest a request waits for the store before it is unreachable
ACTOR_START_S = 30.0  # ... but the memory store's actor, until it first answered: it starts in seconds
LEASE_MARGIN_S = 30.0  # a concurrency lease outlives its request's deadline by this much (then it is freed)
UNREACHABLE_LOG_S = 60.0  # the store unreachable: said in the log at most this often
DOWN_S = 2.0  # ... and not asked again for this long: its requests are answered at once, not after STORE_CALL_S each
NAMESPACE = "serve"
SHARE_S = 0.5  # a replica takes from the store at once what it spends of a key's limit in this long ...
SHARE_OF_REST = 16  # ... but at most this fraction of what the key has left (near the limit: one request at a time)
SHARE_LIFE_S = 1.0  # a share not spent by then is dropped (it stays counted in the store: a bounded, early refusal)
RATE_S = 0.25  # a replica's rate of spending a key's limit, measured over this long
RENEW_WAITS = 3  # a request that finds its share empty waits for at most this many store calls renewing it
POOL_ROOM = 0.5  # finished requests' leases are kept for the key's next ones while the store had this much free ...
POOL_MIN_FREE = 8  # ... and at least this many
LEASE_IDLE_S = 1.0  # a kept lease no request took for this long is given back to the store
LEASE_REUSE_S = LEASE_MARGIN_S / 2  # ... and one this old is given back, not reused (its deadline must outlast a request)
UNCOUNTED = object()  # the store unreachable and limited keys let through (rate_limit_unreachable: open)

# Lua on Redis: one lease of `limit` for a key, atomically (expired ones dropped first)
_LEASE_SCRIPT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
if held >= tonumber(ARGV[3]) then return -1 end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[4])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) - tonumber(ARGV[1])) + 1)
return held + 1
"""


def store_name(app: str) -> str:
    """The memory store's actor name: one per application (service/deployment.py kills it when the app is
    deleted)."""
    return f"encoder-quotas-{app}"


@dataclass(frozen=True)
class Window:
    """One limit of a key, after this request: OpenAI's x-ratelimit-limit/remaining/reset."""

    limit: int
    remaining: int
    reset_s: float


class RateLimited(ServiceError):
    """A key past one of its limits: 429, its type the limit (`requests`, `tokens`, `concurrent`)."""

    def __init__(self, kind: str, message: str, retry_after_s: int) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.type = kind


def limited(key: ApiKey | None) -> bool:
    return key is not None and (key.requests_per_minute is not None or key.tokens_per_minute is not None
                                or key.concurrent is not None)


def duration(seconds: float) -> str:
    """OpenAI's reset durations: `20ms`, `1s`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds, 3), 60)
    return f"{int(minutes)}m{rest:g}s" if minutes else f"{rest:g}s"


class LimitStore:
    """Counts and leases on one storage: `limits`' memory or Redis storage (and Redis itself for leases)."""

    def __init__(self, uri: str) -> None:
        from limits.aio.storage import MemoryStorage, RedisStorage
        from limits.aio.strategies import SlidingWindowCounterRateLimiter

        self.uri = uri
        if uri.startswith(("redis://", "rediss://")):
            import redis.asyncio

            from redis.asyncio.retry import Retry
            from redis.backoff import ExponentialBackoff

            # a connection Redis closed (it restarted) is tried again at once on a new one, within STORE_CALL_S
            retry = {"retry": Retry(ExponentialBackoff(cap=0.05, base=0.01), 2),
                     "retry_on_error": [redis.exceptions.ConnectionError]}
            self.storage = RedisStorage(uri, implementation="redispy", wrap_exceptions=True, socket_timeout=STORE_CALL_S,
                                        socket_connect_timeout=STORE_CALL_S, **retry)
            self.redis = redis.asyncio.from_url(uri, socket_timeout=STORE_CALL_S, socket_connect_timeout=STORE_CALL_S,
                                                **retry)
            self.lease_script = self.redis.register_script(_LEASE_SCRIPT)
            self.leases: dict[str, dict[str, float]] | None = None
        else:
            self.storage, self.redis, self.leases = MemoryStorage(), None, {}
        self.limiter = SlidingWindowCounterRateLimiter(self.storage)

    async def charge(self, name: str, kind: str, per_minute: int, cost: int) -> tuple[bool, Window]:
        """`cost` more of `kind` for key `name` within `per_minute`: whether it fits (it is counted only if it
        does), and the window after it."""
        allowed, _, window = await self.charge_share(name, kind, per_minute, cost, 0)
        return allowed, window

    async def charge_share(self, name: str, kind: str, per_minute: int, cost: int,
                           extra: int) -> tuple[bool, int, Window]:
        """`charge`, and `extra` more for the replica's share when they fit too: (allowed, the extra counted (0 or
        `extra`), the window after them)."""
        from limits import RateLimitItemPerMinute

        item = RateLimitItemPerMinute(per_minute)
        granted = extra if extra > 0 and await self.limiter.hit(item, "encoder", name, kind, cost=cost + extra) else 0
        allowed = granted > 0 or cost <= 0 or await self.limiter.hit(item, "encoder", name, kind, cost=cost)
        stats = await self.limiter.get_window_stats(item, "encoder", name, kind)
        return allowed, granted, Window(per_minute, max(0, int(stats.remaining)), max(0.0, stats.reset_time - time.time()))

    async def admit(self, name: str, concurrent: int | None, ttl_s: float, lease: str | None,
                    requests_per_minute: int | None, tokens_per_minute: int | None, extra_requests: int = 0) -> dict:
        """A request of key `name`, in one call (one Ray hop for the memory store, where each hop costs): its
        concurrent lease (`lease`, when it has a `concurrent` limit), then its one request counted (and
        `extra_requests` more for the replica's share when they fit), then its tokens' window looked at; it stops
        at the first limit that refuses. {"lease": the lease or None, "held": the key's leases held after it,
        "requests": (allowed, Window) or None, "granted": the extra requests counted, "tokens": Window or None}."""
        answer: dict = {"lease": None, "held": 0, "requests": None, "granted": 0, "tokens": None}
        if concurrent is not None and lease is not None:
            answer["lease"], answer["held"] = await self.lease_counted(name, concurrent, ttl_s, lease)
            if answer["lease"] is None:
                return answer
        if requests_per_minute is not None:
            allowed, answer["granted"], window = await self.charge_share(name, "requests", requests_per_minute, 1,
                                                                         extra_requests)
            answer["requests"] = (allowed, window)
            if not allowed:
                return answer
        if tokens_per_minute is not None:
            answer["tokens"] = (await self.charge(name, "tokens", tokens_per_minute, 0))[1]
        return answer

    async def lease(self, name: str, limit: int, ttl_s: float, lease: str) -> str | None:
        """Lease `lease`, one of key `name`'s `limit` concurrent requests, held until `release` or `ttl_s`; None:
        all taken. (Its id is the caller's: a lease whose answer was lost on the way is released by it.)"""
        return (await self.lease_counted(name, limit, ttl_s, lease))[0]

    async def lease_counted(self, name: str, limit: int, ttl_s: float, lease: str) -> tuple[str | None, int]:
        """`lease`, and how many of the key's leases are held after it."""
        now = time.time()
        if self.redis is not None:
            held = int(await self.lease_script(keys=[f"encoder:concurrent:{name}"], args=[now, now + ttl_s, limit, lease]))
            return (lease, held) if held >= 0 else (None, limit)
        held = self.leases.setdefault(name, {})
        for stale in [k for k, expiry in held.items() if expiry <= now]:
            del held[stale]
        if len(held) >= limit:
            return None, len(held)
        held[lease] = now + ttl_s
        return lease, len(held)

    async def in_flight(self, name: str) -> int:
        """Key `name`'s concurrent leases held now."""
        now = time.time()
        if self.redis is not None:
            return int(await self.redis.zcount(f"encoder:concurrent:{name}", f"({now}", "+inf"))
        return sum(1 for expiry in self.leases.get(name, {}).values() if expiry > now)

    async def release(self, name: str, lease: str) -> None:
        if self.redis is not None:
            await self.redis.zrem(f"encoder:concurrent:{name}", lease)
        else:
            self.leases.get(name, {}).pop(lease, None)


class RemoteStore:
    """The memory store in one Ray actor per application: shared by every replica of every node."""

    def __init__(self, app: str) -> None:
        self.uri, self.app, self._actor, self.answered = "memory://", app, None, False

    @property
    def actor(self) -> Any:
        """The actor, started (or found) when a replica with a keys file starts, or by the first limited request."""
        if self._actor is None:
            import ray

            self._actor = ray.remote(LimitStore).options(
                name=store_name(self.app), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                num_cpus=0, max_restarts=-1, enable_task_events=False).remote("memory://")  # (events: GCS work a call)
        return self._actor

    @property
    def call_timeout_s(self) -> float:
        return STORE_CALL_S if self.answered else ACTOR_START_S

    async def _answer(self, ref: Any) -> Any:
        result = await ref
        self.answered = True
        return result

    async def charge(self, name: str, kind: str, per_minute: int, cost: int) -> tuple[bool, Window]:
        return await self._answer(self.actor.charge.remote(name, kind, per_minute, cost))

    async def charge_share(self, name: str, kind: str, per_minute: int, cost: int,
                           extra: int) -> tuple[bool, int, Window]:
        return await self._answer(self.actor.charge_share.remote(name, kind, per_minute, cost, extra))

    async def admit(self, name: str, concurrent: int | None, ttl_s: float, lease: str | None,
                    requests_per_minute: int | None, tokens_per_minute: int | None, extra_requests: int = 0) -> dict:
        return await self._answer(self.actor.admit.remote(name, concurrent, ttl_s, lease, requests_per_minute,
                                                          tokens_per_minute, extra_requests))

    async def lease(self, name: str, limit: int, ttl_s: float, lease: str) -> str | None:
        return await self._answer(self.actor.lease.remote(name, limit, ttl_s, lease))

    async def in_flight(self, name: str) -> int:
        return await self._answer(self.actor.in_flight.remote(name))

    async def release(self, name: str, lease: str) -> None:
        await self._answer(self.actor.release.remote(name, lease))


class Share:
    """A replica's share of one per-minute limit of a key: units the store already counted for this replica that it
    has not spent, spent here without a store call until they run out or SHARE_LIFE_S passes."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self.units = 0
        self.expires = float("-inf")
        self.window: Window | None = None  # the store's, when the share was taken ...
        self.at = 0.0  # ... at this time
        self.spent, self.since, self.rate = 0, time.monotonic(), 0.0  # units a second this replica spends
        self.asking: asyncio.Future | None = None  # a store call under way that renews the share

    def note(self, cost: int, now: float) -> None:
        """`cost` spent by a request of the key (from the share or from the store): its rate, every RATE_S."""
        if now - self.since >= RATE_S:
            self.rate, self.spent, self.since = self.spent / (now - self.since), 0, now
        self.spent += cost

    def rate_now(self) -> float:
        """Units a second: the last RATE_S's, or more when this RATE_S already spent more (a key that comes back
        after an idle spell or speeds up is not one store call per request until its rate is measured)."""
        return max(self.rate, self.spent / RATE_S)

    def take(self, cost: int, now: float) -> Window | None:
        """`cost` from the share, and the window as this replica sees it then; None when the share cannot pay."""
        if self.window is None or now >= self.expires or self.units < cost:
            return None
        self.units -= cost
        return self.seen(now)

    def fresh(self, now: float) -> Window | None:
        """The window while the share is alive and the key is not out of it (a key out of it asks the store)."""
        if self.window is None or now >= self.expires or self.window.remaining + self.units <= 0:
            return None
        return self.seen(now)

    def seen(self, now: float) -> Window:
        window = self.window
        return Window(window.limit, window.remaining + self.units, max(0.0, window.reset_s - (now - self.at)))

    def extra(self, cost: int) -> int:
        """How many more than `cost` to ask the store for: what this replica spends in SHARE_S, at most
        1/SHARE_OF_REST of what the key had left at the last answer (none before the first)."""
        if self.window is None:
            return 0
        return max(0, min(int(self.rate_now() * SHARE_S), (self.window.remaining - cost) // SHARE_OF_REST))

    @contextlib.contextmanager
    def renewing(self) -> Iterator[None]:
        """Around a store call that renews the share: requests that find it empty meanwhile wait for it
        (`after_renewal`)."""
        if self.asking is not None:  # (another call renews it already)
            yield
            return
        self.asking = asyncio.get_running_loop().create_future()
        try:
            yield
        finally:
            self.asking.set_result(None)
            self.asking = None

    async def after_renewal(self, look: Callable[[float], Window | None]) -> Window | None:
        """`look` (`take` or `fresh`) now, and again after the store call renewing the share when one was under way
        (at most RENEW_WAITS of them): a burst that finds the share empty waits for one store call, not one each."""
        window = look(time.monotonic())
        for _ in range(RENEW_WAITS):
            if window is not None or self.asking is None:
                break
            await asyncio.shield(self.asking)
            window = look(time.monotonic())
        return window

    def granted(self, extra: int, window: Window, now: float) -> None:
        """The store counted `extra` more for this replica (0: none), the window after them."""
        self.units = (self.units if now < self.expires else 0) + extra
        self.window, self.at, self.expires = window, now, now + SHARE_LIFE_S


class LeasePool:
    """A replica's concurrent leases of one key that no request holds now: kept for the key's next request (no store
    call) while the store had room at its last answer, given back after LEASE_IDLE_S idle or LEASE_REUSE_S old."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.idle: list[tuple[str, float, float]] = []  # (lease, taken at, idle since), newest last
        self.taken: dict[str, float] = {}  # leases requests hold now -> when the store gave them
        self.roomy = False

    def take(self, now: float) -> str | None:
        """The newest kept lease, if it is young enough to reuse."""
        if not self.idle:
            return None
        lease, taken_at, _ = self.idle.pop()
        if now - taken_at >= LEASE_REUSE_S:
            self.idle.insert(0, (lease, taken_at, 0.0))  # too old: left for `stale` to give back
            return None
        self.taken[lease] = taken_at
        return lease

    def given(self, lease: str, held: int, now: float) -> None:
        """The store gave `lease`; `held` of the key's leases are held now."""
        self.taken[lease] = now
        free = self.limit - held
        self.roomy = free >= max(POOL_MIN_FREE, POOL_ROOM * self.limit)

    def keep(self, lease: str, now: float) -> bool:
        """A finished request's lease: kept for the next one (True) or to be given back to the store (False)."""
        taken_at = self.taken.pop(lease, None)
        if taken_at is None or not self.roomy or now - taken_at >= LEASE_REUSE_S:
            return False
        self.idle.append((lease, taken_at, now))
        return True

    def stale(self, now: float) -> list[str]:
        """The kept leases to give back now: idle LEASE_IDLE_S, or too old to reuse."""
        out = [lease for lease, taken_at, since in self.idle
               if now - since >= LEASE_IDLE_S or now - taken_at >= LEASE_REUSE_S]
        if out:
            self.idle = [entry for entry in self.idle if entry[0] not in out]
        return out


class Quotas:
    """The replica's side: admit a limited key's request, count its tokens, free its lease. Class attributes,
    set when a replica starts (as Gate's)."""

    store: Any = None  # LimitStore (Redis) or RemoteStore (the memory actor); None: no key has limits yet
    fail_open = False  # rate_limit_unreachable: open
    lease_ttl_s = 60.0
    _said_at = float("-inf")
    _down_until = float("-inf")  # the store was unreachable: not asked again before then

    @classmethod
    def configure(cls, settings: ServiceSettings, app: str | None) -> None:
        uri = settings.rate_limit_storage
        cls.store = LimitStore(uri) if uri != "memory://" or app is None else RemoteStore(app)
        if isinstance(cls.store, RemoteStore) and settings.keys_file is not None:
            _ = cls.store.actor  # started now, not by the first limited request (keys may get limits later)
        cls.fail_open = settings.rate_limit_unreachable == "open"
        cls.lease_ttl_s = settings.request_timeout_s + LEASE_MARGIN_S
        cls.shares, cls.pools = {}, {}

    @classmethod
    async def _ask(cls, what: Any) -> Any:
        """One call to the store within STORE_CALL_S (none for DOWN_S after one failed); NotReady (503) when it
        cannot be reached and limited keys fail closed, UNCOUNTED when they fail open."""
        if time.monotonic() < cls._down_until:
            what.close()  # (the coroutine, never started)
            return cls._unreachable(None)
        try:
            return await asyncio.wait_for(what, getattr(cls.store, "call_timeout_s", STORE_CALL_S))
        except (ServiceError, asyncio.CancelledError):
            raise
        except Exception as exc:  # Redis down, the actor gone, a timeout: the store is unreachable
            cls._down_until = time.monotonic() + DOWN_S
            return cls._unreachable(exc)

    @classmethod
    def _unreachable(cls, exc: Exception | None) -> Any:
        now = time.monotonic()
        if exc is not None and now - cls._said_at >= UNREACHABLE_LOG_S:
            cls._said_at = now
            logger.warning("rate-limit store %s unreachable (%s: %s): requests of keys with limits are %s",
                           cls.store.uri, type(exc).__name__, exc, "let through uncounted" if cls.fail_open
                           else "refused with 503 (rate_limit_unreachable: closed)")
        if cls.fail_open:
            return UNCOUNTED
        raise NotReady("the rate-limit store is unreachable, and this key has limits (rate_limit_unreachable: "
                       "closed): retry shortly", retry_after_s=1)

    shares: dict[tuple[str, str], Share] = {}  # (key, "requests" or "tokens") -> this replica's share
    pools: dict[str, LeasePool] = {}  # key -> this replica's kept leases

    @classmethod
    def _share(cls, name: str, kind: str, per_minute: int | None) -> Share | None:
        if per_minute is None:
            return None
        share = cls.shares.get((name, kind))
        if share is None or share.per_minute != per_minute:  # (a keys file that changed the limit: a new share)
            share = cls.shares[(name, kind)] = Share(per_minute)
        return share

    @classmethod
    def _pool(cls, key: ApiKey) -> LeasePool | None:
        if key.concurrent is None:
            return None
        pool = cls.pools.get(key.name)
        if pool is None or pool.limit != key.concurrent:
            pool = cls.pools[key.name] = LeasePool(key.concurrent)
        return pool

    @classmethod
    async def admit(cls, call: Call) -> None:
        """A limited key's request: its concurrent lease, its request counted, its tokens' window looked at
        (a key out of tokens is refused before its body is read), from this replica's shares and kept leases where
        they can, else in one store call. RateLimited past a limit."""
        key = call.key
        if not limited(key) or cls.store is None:
            return
        now = time.monotonic()
        requests = cls._share(key.name, "requests", key.requests_per_minute)
        tokens = cls._share(key.name, "tokens", key.tokens_per_minute)
        pool = cls._pool(key)
        try:
            call.lease = pool.take(now) if pool is not None else None
            new_lease = pool is not None and call.lease is None
            if new_lease:
                call.lease = uuid.uuid4().hex  # released at the call's end, or below, even if the answer is lost
            if requests is not None:
                requests.note(1, now)
                if (window := await requests.after_renewal(lambda at: requests.take(1, at))) is not None:
                    call.limits["requests"] = window
            if tokens is not None and (window := await tokens.after_renewal(tokens.fresh)) is not None:
                call.limits["tokens"] = window
            ask_requests = requests is not None and "requests" not in call.limits
            ask_tokens = tokens is not None and "tokens" not in call.limits
            if new_lease or ask_requests or ask_tokens:
                await cls._admit_in_store(call, key, pool if new_lease else None, requests if ask_requests else None,
                                          tokens if ask_tokens else None, time.monotonic())
        except BaseException:
            await cls.release(call)
            raise

    @classmethod
    async def _admit_in_store(cls, call: Call, key: ApiKey, pool: LeasePool | None, requests: Share | None,
                              tokens: Share | None, now: float) -> None:
        """What this replica's shares and kept leases could not give, in one store call."""
        with contextlib.ExitStack() as renewing:
            for share in (requests, tokens):
                if share is not None:
                    renewing.enter_context(share.renewing())
            answer = await cls._ask(cls.store.admit(
                key.name, key.concurrent if pool is not None else None, cls.lease_ttl_s, call.lease,
                key.requests_per_minute if requests is not None else None,
                key.tokens_per_minute if tokens is not None else None, requests.extra(1) if requests is not None else 0))
        if answer is UNCOUNTED:
            call.lease = None if pool is not None else call.lease
            return
        if pool is not None:
            if answer["lease"] is None:
                call.lease = None
                raise RateLimited("concurrent", f"the key {key.name!r} has {key.concurrent} requests in flight, "
                                  "its `concurrent` limit: retry once one is answered", retry_after_s=1)
            pool.given(call.lease, answer["held"], now)
        if answer["requests"] is not None:
            allowed, window = answer["requests"]
            requests.granted(answer["granted"], window, now)
            call.limits["requests"] = requests.seen(now) if allowed else window
            if not allowed:
                raise RateLimited("requests", f"the key {key.name!r} is past its {key.requests_per_minute} "
                                  f"requests per minute: retry in {duration(window.reset_s)}",
                                  retry_after_s=max(1, math.ceil(window.reset_s)))
        if answer["tokens"] is not None:
            tokens.granted(0, answer["tokens"], now)
            call.limits["tokens"] = tokens.seen(now)
            if call.limits["tokens"].remaining <= 0:
                raise cls._out_of_tokens(key, call.limits["tokens"], 0)

    @classmethod
    async def charge_tokens(cls, call: Call, tokens: int) -> None:
        """The tokens a limited key's request sends to inference, counted before they are batched (from this
        replica's share where it can pay them); RateLimited (and nothing counted) when they do not fit its tokens
        per minute."""
        key = call.key
        if key is None or key.tokens_per_minute is None or cls.store is None or tokens <= 0:
            return
        now = time.monotonic()
        share = cls._share(key.name, "tokens", key.tokens_per_minute)
        share.note(tokens, now)
        if (window := await share.after_renewal(lambda at: share.take(tokens, at))) is not None:
            call.limits["tokens"] = window
            return
        now = time.monotonic()
        with share.renewing():
            answer = await cls._ask(cls.store.charge_share(key.name, "tokens", key.tokens_per_minute, tokens,
                                                           share.extra(tokens)))
        if answer is UNCOUNTED:
            return
        allowed, granted, window = answer
        share.granted(granted, window, now)
        call.limits["tokens"] = share.seen(now)
        if not allowed:
            raise cls._out_of_tokens(key, call.limits["tokens"], tokens)

    @staticmethod
    def tokens_wait_s(key: ApiKey, window: Window, tokens: int) -> int:
        """Seconds before `tokens` more fit the key's tokens per minute: at least the time the window takes to
        free that many at its rate (a large request waits longer than the next token), at most a minute."""
        return max(1, min(60, math.ceil(max(window.reset_s, 60 * (tokens - window.remaining) / key.tokens_per_minute))))

    @classmethod
    async def usage(cls, key: ApiKey) -> dict[str, Window]:
        """Where `key` stands now in each of its limits (nothing counted); {} without limits or store."""
        if not limited(key) or cls.store is None:
            return {}
        now: dict[str, Window] = {}
        for kind, per_minute in (("requests", key.requests_per_minute), ("tokens", key.tokens_per_minute)):
            if per_minute is not None:
                answer = await cls._ask(cls.store.charge(key.name, kind, per_minute, 0))
                if answer is not UNCOUNTED:
                    now[kind] = answer[1]
        if key.concurrent is not None:
            held = await cls._ask(cls.store.in_flight(key.name))
            if held is not UNCOUNTED:
                now["concurrent"] = Window(key.concurrent, max(0, key.concurrent - held), 0.0)
        return now

    @staticmethod
    def _out_of_tokens(key: ApiKey, window: Window, tokens: int) -> RateLimited:
        if tokens > key.tokens_per_minute:
            return RateLimited("tokens", f"this request's {tokens} tokens are more than the key {key.name!r}'s "
                               f"{key.tokens_per_minute} tokens per minute: send fewer texts at once", retry_after_s=60)
        asked = f"this request's {tokens} tokens; " if tokens else ""
        wait = Quotas.tokens_wait_s(key, window, tokens)
        return RateLimited("tokens", f"the key {key.name!r} is past its {key.tokens_per_minute} tokens per minute "
                           f"({asked}{window.remaining} left): retry in {duration(wait)}", retry_after_s=wait)

    _releasing: set[asyncio.Task] = set()  # lease releases under way (held here: a task nobody holds may vanish)
    _sweeper: asyncio.Task | None = None  # gives back kept leases gone idle, while there are any

    @classmethod
    def release_soon(cls, call: Call) -> None:
        """The call's lease kept for the key's next request, or given back without waiting for the store (the
        call's record goes on meanwhile)."""
        if call.lease is None or call.key is None:
            return
        pool = cls.pools.get(call.key.name)
        if pool is not None and pool.keep(call.lease, time.monotonic()):
            call.lease = None
            if cls._sweeper is None or cls._sweeper.done():
                cls._sweeper = asyncio.get_running_loop().create_task(cls._sweep())
            return
        cls._in_background(cls._give_back(call.key.name, call.lease))
        call.lease = None

    @classmethod
    def _in_background(cls, what: Any) -> None:
        task = asyncio.get_running_loop().create_task(what)
        cls._releasing.add(task)
        task.add_done_callback(cls._releasing.discard)

    @classmethod
    async def _sweep(cls) -> None:
        """Kept leases no request took within LEASE_IDLE_S given back, every half of it, until none is kept."""
        while any(pool.idle for pool in cls.pools.values()):
            await asyncio.sleep(LEASE_IDLE_S / 2)
            now = time.monotonic()
            for name, pool in list(cls.pools.items()):
                for lease in pool.stale(now):
                    cls._in_background(cls._give_back(name, lease))

    @classmethod
    async def release(cls, call: Call) -> None:
        """The call's concurrent lease given back (a lost one expires with its deadline)."""
        lease, call.lease = call.lease, None
        if lease is not None and call.key is not None:
            pool = cls.pools.get(call.key.name)
            if pool is not None:
                pool.taken.pop(lease, None)
            await cls._give_back(call.key.name, lease)

    @classmethod
    async def _give_back(cls, name: str, lease: str) -> None:
        if cls.store is None or time.monotonic() < cls._down_until:
            return  # (a lease the store could not be told of expires with its deadline)
        try:
            await asyncio.wait_for(cls.store.release(name, lease), STORE_CALL_S)
        except Exception:  # it expires by itself
            pass


def headers(call: Call) -> list[tuple[str, str]]:
    """OpenAI's x-ratelimit-* headers (and gRPC trailing metadata) for a limited key's answer."""
    out = []
    for kind, window in call.limits.items():
        out += [(f"x-ratelimit-limit-{kind}", str(window.limit)),
                (f"x-ratelimit-remaining-{kind}", str(window.remaining)),
                (f"x-ratelimit-reset-{kind}", duration(window.reset_s))]
    return out
