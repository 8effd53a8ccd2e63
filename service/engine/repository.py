"""The model repository (issue 57): a directory of bundles, each available by its directory's name without
being loaded. A replica loads one the first time a request there names it (the request waits, within its
deadline; a second request for the same model waits on the same load), keeps it while it is used, and
unloads the idle one used least lately (a decayed count of its requests, then recency) when its memory budget
needs the room, when it has been idle for
`idle_unload_s`, or when its directory is removed. Eager models (the Serve config's `bundles`, a
repository's default) are loaded at start and never unloaded; they are not counted in the budget.

What a loaded model costs is measured, not assumed: the replica's resident memory before and after its load
(its sessions built and run once), never counted below its fp32 graph files' size (memory an unload freed and
this load reused is not in the difference). Before its first load a model is reckoned at those files' size.

Nothing here knows HTTP or Ray Serve: the routes call `ensure` (through EncoderService.load_if_needed, which
counts a request for a loaded model with `used`) and the repository API (service/apis/kserve_v2) `index`,
`load` and `unload`; `on_held` tells whoever routes (service/hosting/model_routing.py) what is held here, and
`placement` (service/hosting/placement.py) what the other replicas hold: the models this one keeps loaded
(min_loaded), may load (max_loaded) and gives up for another.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from bundle.contract import BUNDLE_MANIFEST
from bundle.manifest import BundleError, BundleManifest
from service.config import BundleRef, valid_model_name
from service.engine.engine import Engine, EngineTable, shown
from service.engine.errors import BadRequest, NotFound, ServiceError, Timeout
from service.observability.metrics import service_metrics

logger = logging.getLogger("ray.serve")

SCAN_PERIOD_S = 1.0  # the directory is listed again at most this often, unless a name is not found:
MISS_SCAN_PERIOD_S = 0.2  # then at most this often (a flood of unknown names lists it five times a second)
SWEEP_PERIOD_S = 1.0  # idle and removed models are looked for this often
RETRY_FAILED_S = 30.0  # a bundle that failed to load is tried again after this long (or when its files change)
# What makes room: the idle model used least lately, a count of its requests halved every this many seconds, so
# that a flood of requests each naming another cold model unloads cold ones, not the hot model used all along
# (plain recency did: between two of its requests on a replica, each cold load was more recent)
USES_HALF_LIFE_S = 30.0
# A model used more than this many times as lately as the one a load is for is not unloaded for it: that load is
# refused (503, Retry-After) instead. Models used about as often (a rotation) make room for each other.
HOTTER_BY = 2.0
ROOM_POLL_S = 0.05  # how often a load held by models in use looks for room again (within LOAD_WAIT_S)
LOAD_WAIT_S = 5.0  # the longest a load waits for a load slot (within the request's deadline) ...
MAX_WAITING_LOADS = 8  # ... and how many wait at once on a replica; past either, 503 with Retry-After
KEEP_LOAD_S = 120.0  # a model kept for min_loaded may take this long to load (a request's deadline is shorter)
GIVE_WAY_IDLE_S = 2.0  # a model another replica was refused at its max_loaded is given up once idle this long
GRAPH_SUFFIXES = (".onnx", ".onnx.data", ".xml", ".bin")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"


class Placement(Protocol):
    """What the other replicas hold (service/hosting/placement.py, on Ray): the repository only asks."""

    async def report(self, held: list[str]) -> None: ...  # what this replica holds now; the others' view back

    async def may_load(self, model: str) -> bool: ...  # False while its max_loaded other replicas hold it

    def max_loaded(self, model: str) -> int | None: ...

    def keep(self) -> set[str]: ...  # the models this replica keeps loaded for their min_loaded

    def give_way(self) -> set[str]: ...  # held here and refused to another replica at their max_loaded


class ModelsBusy(ServiceError):
    """A load that cannot start now: the budget is held by models in use, or every load slot is taken (503)."""

    type = "overloaded"
    in_use: bool = False  # the room is held by models with requests now: there a moment later


class ModelElsewhere(ServiceError):
    """A model at its max_loaded on other replicas: this one does not load it (503; the ingress routes its next
    requests to a replica holding it, and one holding it gives it up for this one once idle there)."""

    type = "overloaded"


class ModelUnavailable(ServiceError):
    """A bundle of the repository that does not load (bad hashes, a half-copied directory): 503 naming why."""

    type = "not_ready"


def resident_bytes() -> int:
    """This process's resident memory (Linux's /proc/self/statm; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def graph_bytes(path: Path) -> int:
    """The bytes of a bundle's fp32 graphs (what a replica loads by default): the reckoning before a load."""
    total = 0
    for p in path.iterdir():
        if p.name.endswith(GRAPH_SUFFIXES) and "int8" not in p.name and "fp16" not in p.name:
            total += p.stat().st_size
    return total


def give_back_memory() -> None:
    """Freed sessions' memory back to the system (glibc keeps freed pages otherwise). No garbage collection:
    an unloaded engine's batcher drops its references (Batcher.close), so no cycle holds its sessions, and a
    full collection costs the event loop 100 ms or more."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Entry:
    """One model of the repository, as this replica sees it."""

    name: str
    path: Path
    eager: bool = False  # loaded at start, never unloaded (a `bundles` entry, or the repository's default)
    engine: Engine | None = None
    bytes: int = 0  # measured at its last load (0: never loaded here)
    last_used: float = 0.0
    uses: float = 0.0  # requests that used it, each weighing half as much every USES_HALF_LIFE_S (at last_used)

    def used(self) -> None:
        now = time.monotonic()
        self.uses = self.uses_at(now) + 1.0
        self.last_used = now

    def uses_at(self, now: float) -> float:
        return self.uses * 0.5 ** ((now - self.last_used) / USES_HALF_LIFE_S)

    def victim_order(self, now: float) -> tuple[float, float]:
        """Unloaded first: the least used lately (a decayed count), then the least recently used."""
        return self.uses_at(now), self.last_used
    loading: asyncio.Future | None = None
    failed: str = ""  # why its last load failed, shown as the index's reason
    failed_at: float = 0.0
    failed_stamp: float = 0.0  # its manifest's mtime when it failed: a new copy is tried at once
    removed: bool = False  # its directory is gone: unloaded once idle
    loads: int = 0  # times it was loaded on this replica
    waiters: int = 0  # requests waiting on its load: once it ends, it is theirs before any other load's room
    manifest: BundleManifest | None = None  # read (not verified) to describe it before it loads
    manifest_stamp: float = -1.0

    @property
    def state(self) -> str:
        if self.engine is not None:
            return READY
        if self.loading is not None:
            return LOADING
        return UNAVAILABLE

    def idle(self) -> bool:
        """Loaded, and nothing needs it: no call holds it, none waits to (its load just ended), nothing queued."""
        e = self.engine
        return e is not None and self.waiters == 0 and e.leases == 0 and e.batcher.queued == 0 \
            and e.batcher.held == 0 and e.runner.running == 0


@dataclass
class ModelRepository:
    """The repository's models on this replica: which are available, which loaded, and the room left."""

    directory: Path | None
    engines: EngineTable
    loader: Callable[[BundleRef], Engine]  # blocking: load_engine with the replica's settings and device
    budget_bytes: int
    max_concurrent_loads: int = 1
    idle_unload_s: float = 0.0
    entries: dict[str, Entry] = field(default_factory=dict)
    scanned_at: float = float("-inf")
    loads_running: int = 0
    reserved: int = 0  # bytes reckoned for the loads running now
    scan_error: str = ""
    _waiting: list = field(default_factory=list)  # (entry, future) of loads waiting for a slot (_load_slot)
    _pending_unload: set[str] = field(default_factory=set)  # asked to unload while in use: the sweeper's, once idle
    _sweeper: asyncio.Task | None = None
    # told the names of the models held or loading here each time they change: Ray Serve's routers then send a
    # request naming one to a replica that holds it (service/hosting/model_routing.py); None: nobody to tell
    on_held: Callable[[list[str]], None] | None = None
    _told: tuple[str, ...] | None = None
    placement: Placement | None = None  # the other replicas' holdings (min_loaded, max_loaded); None: alone
    kept: set[str] = field(default_factory=set)  # held here for min_loaded: loaded at once, never unloaded
    _keeping: set[str] = field(default_factory=set)  # kept models whose load is running (_keep_loaded)

    def __post_init__(self) -> None:
        for engine in self.engines:  # the eager ones, loaded at start
            self.entries[engine.name] = Entry(engine.name, engine.path, eager=True, engine=engine)
        self.scan(force=True)
        self._tell_held()
        try:  # in a replica (its event loop runs its constructor): kept models load from the start
            asyncio.get_running_loop()
            self._start_sweeper()
        except RuntimeError:  # (no loop: started by the first request)
            pass

    # ---- what is available ----

    def scan(self, force: bool = False) -> None:
        """List the directory again (at most every SCAN_PERIOD_S unless forced): new bundles become available,
        removed ones are marked to unload once idle. An unreadable directory keeps what was known, and says so."""
        now = time.monotonic()
        if self.directory is None or (not force and now - self.scanned_at < SCAN_PERIOD_S):
            return
        self.scanned_at = now
        try:
            found = {p.name: p for p in self.directory.iterdir()
                     if valid_model_name(p.name) and (p / BUNDLE_MANIFEST).is_file()}
            self.scan_error = ""
        except OSError as exc:
            if not self.scan_error:
                logger.warning("model repository %s is unreadable (%s); serving what was listed before",
                               self.directory, exc.strerror or exc)
            self.scan_error = f"the repository directory is unreadable: {exc.strerror or exc}"
            return
        for name, path in found.items():
            entry = self.entries.get(name)
            if entry is None:
                self.entries[name] = Entry(name, path)
            elif entry.removed:  # copied back before its unload: served again
                entry.removed = False
                if entry.engine is not None and name not in self.engines.by_name:
                    self.engines.add(entry.engine)
        for name, entry in list(self.entries.items()):
            if not entry.eager and name not in found and not entry.removed:
                if entry.engine is None and entry.loading is None:
                    del self.entries[name]
                else:  # no new request reaches it (404); those in flight finish on it, then the sweeper unloads it
                    entry.removed = True
                    if self.engines.by_name.get(name) is entry.engine:
                        self.engines.remove(name)
        self._tell_held()

    def available(self) -> list[str]:
        self.scan()
        return [n for n, e in self.entries.items() if not e.removed]

    def used_bytes(self) -> int:
        return sum(e.bytes for e in self.entries.values() if e.engine is not None and not e.eager) + self.reserved

    def index(self) -> list[dict]:
        """Every model with its state on this replica (KServe v2's repository index, with our bytes)."""
        self.scan()
        rows = []
        for name, e in sorted(self.entries.items()):
            reason = e.failed if e.state == UNAVAILABLE and e.failed else ("removed from the repository"
                                                                           if e.removed else "")
            rows.append({"name": name, "version": "1", "state": e.state, "reason": reason,
                         "load": "eager" if e.eager else "on-demand", "bytes": e.bytes})
        return rows

    def models(self) -> list[tuple[str, Engine | None, BundleManifest | None]]:
        """Every available model: its engine where loaded here, else its manifest as read (None: unreadable),
        to describe it without loading it (/v1/models)."""
        self.scan()
        return [(name, e.engine, e.engine.manifest if e.engine is not None else self.manifest_of(e))
                for name, e in sorted(self.entries.items()) if not e.removed]

    def manifest_of(self, entry: Entry) -> BundleManifest | None:
        stamp = self._stamp(entry)
        if stamp != entry.manifest_stamp:
            entry.manifest_stamp = stamp
            try:
                entry.manifest = BundleManifest.model_validate_json((entry.path / BUNDLE_MANIFEST).read_bytes())
            except (OSError, ValueError):
                entry.manifest = None
        return entry.manifest

    # ---- loading ----

    def knows(self, name: str) -> bool:
        """Whether `name` is one of the repository's models (loaded or not); lists the directory at once
        when it is not known yet (a bundle just copied in is found by its first request)."""
        if name in self.entries and not self.entries[name].removed:
            return True
        if self.directory is None or not valid_model_name(name):
            return False
        if time.monotonic() - self.scanned_at >= MISS_SCAN_PERIOD_S:
            self.scan(force=True)
        return name in self.entries and not self.entries[name].removed

    async def _known(self, name: str) -> bool:
        """knows(name), and when the directory was listed too recently to list it again (a bundle whose copy
        ended just after that listing), once more as soon as it may be."""
        if self.knows(name):
            return True
        wait = MISS_SCAN_PERIOD_S - (time.monotonic() - self.scanned_at)
        if wait <= 0 or self.directory is None or not valid_model_name(name):
            return False
        await asyncio.sleep(wait)
        if name not in self.entries and time.monotonic() - self.scanned_at >= MISS_SCAN_PERIOD_S - 0.01:
            self.scan(force=True)  # (the loop may wake this a hair early: knows() would then not list it again)
        return self.knows(name)

    def used(self, name: str) -> None:
        """A request for a loaded model: counted in its uses (victim_order)."""
        entry = self.entries.get(name)
        if entry is not None:
            entry.used()

    async def ensure(self, name: str, timeout_s: float) -> None:
        """`name` loaded on this replica when it is one of the repository's models, waiting for its load within
        `timeout_s`; any other name is left to the model table, which answers 404 naming the served ones."""
        self._start_sweeper()
        entry = self.entries.get(name)
        if entry is not None and entry.engine is not None and not entry.removed:
            entry.used()
            return
        if not await self._known(name):
            return
        deadline = time.monotonic() + timeout_s
        self.entries[name].used()  # counted as asked for, loaded or not: a model asked for again and again here
        # (a hot one that spills over to this replica) outweighs the models used less, and gets its room
        while True:  # a model evicted between its load and this request's turn is loaded again
            entry = self.entries.get(name)
            if entry is None or entry.removed:  # removed from the directory meanwhile: the table answers 404
                return
            if entry.engine is not None:
                entry.last_used = time.monotonic()
                return
            if entry.loading is None:
                if self.placement is not None and not await self.placement.may_load(name):
                    raise ModelElsewhere(f"model {name!r} is loaded on its max_loaded ({self.placement.max_loaded(name)})"
                                         " other replicas (model_placement): retry; its requests go to them",
                                         retry_after_s=1)
                if entry.engine is not None or entry.loading is not None:  # another request's, meanwhile
                    continue
                entry.loading = asyncio.ensure_future(self._load(entry))
                entry.loading.add_done_callback(lambda f, e=entry: self._loaded(e, f))
                self._tell_held()  # told while it loads: its next requests come here, not to a second load elsewhere
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(f"model {name!r} is still loading on this replica; the request's deadline passed",
                              retry_after_s=1)
            # counted as waiting until this request resumes and takes its lease (no await between the two): a load
            # that ended is not unloaded for another before its requests have it (measured: two cold models
            # unloaded each other's fresh load, one request served for every load)
            entry.waiters += 1
            try:
                await asyncio.wait_for(asyncio.shield(entry.loading), left)
            except asyncio.TimeoutError:
                raise Timeout(f"model {name!r} did not load within the request's deadline ({timeout_s:.1f} s); it "
                              "goes on loading: retry shortly", retry_after_s=1) from None
            finally:
                entry.waiters -= 1

    async def load(self, name: str, timeout_s: float) -> None:
        """The repository API's load: `name` loaded here (404 when it is not in the repository)."""
        if not valid_model_name(name):
            raise BadRequest(f"model name {shown(name)}: a repository's model names are letters, digits, '.', '_' "
                             "and '-' (no '/', no '..')")
        if name not in self.engines.by_name and not await self._known(name):
            raise NotFound(f"model {shown(name)} is not in the model repository (POST /v2/repository/index "
                           "lists it)")
        await self.ensure(name, timeout_s)

    def unload(self, name: str) -> None:
        """The repository API's unload: `name` unloaded here now, or once its requests finish. An eager model
        stays (it is served from the start by configuration)."""
        entry = self.entries.get(name)
        if entry is None:
            raise NotFound(f"model {shown(name)} is not in the model repository (POST /v2/repository/index lists it)")
        if entry.eager:
            raise BadRequest(f"model {name!r} is loaded at start by the service's configuration (`bundles`, or the "
                             "repository's default): it is not unloaded on request")
        if name in self.kept:
            raise BadRequest(f"model {name!r} is kept loaded on this replica for its min_loaded (model_placement): "
                             "it is not unloaded on request")
        if entry.engine is not None:
            if entry.idle():
                self._unload(entry, "unloaded")
            else:
                self._pending_unload.add(name)  # the sweeper unloads it once its requests are done

    async def _load(self, entry: Entry) -> None:
        name = entry.name
        if entry.failed and time.monotonic() - entry.failed_at < RETRY_FAILED_S and \
                self._stamp(entry) == entry.failed_stamp:
            raise ModelUnavailable(f"model {name!r} could not be loaded: {entry.failed}", retry_after_s=int(
                RETRY_FAILED_S))
        await self._load_slot(entry)
        reckoned = 0
        metrics = service_metrics()
        started = time.perf_counter()
        try:
            reckoned = entry.bytes or await asyncio.to_thread(graph_bytes, entry.path)
            await self._room_for(reckoned, entry)
            self.reserved += reckoned
            try:
                before = resident_bytes()
                engine = await asyncio.to_thread(self._load_blocking, entry)
                measured = resident_bytes() - before
            finally:
                self.reserved -= reckoned
        except ModelsBusy:
            raise
        except Exception as exc:  # a bad bundle (BundleError: its hashes, a half-copied file) or a runtime's refusal
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            entry.failed, entry.failed_at, entry.failed_stamp = why, time.monotonic(), self._stamp(entry)
            metrics.model_loads.inc(tags={"model": name, "outcome": "failed"})
            logger.error("model %s: not loaded: %s", name, why, exc_info=not isinstance(exc, BundleError))
            raise ModelUnavailable(f"model {name!r} could not be loaded: {why}", retry_after_s=int(RETRY_FAILED_S)) \
                from None
        finally:
            self.loads_running -= 1
            self._hand_on_slot()
        # never below its graphs' bytes: memory freed by an earlier unload and reused by this load is not in the
        # difference, and with several loads at once each one's difference holds the others'
        entry.bytes = max(measured, reckoned, 1 << 20)
        entry.failed = ""
        entry.loads += 1
        entry.engine = engine
        entry.last_used = time.monotonic()  # its first use is the request that waited for it (above)
        if not entry.removed:  # (removed while it loaded: the sweeper unloads it)
            self.engines.add(engine)
        self._trim(keep=entry)  # its first load was reckoned at its files' size: what it measured may need more
        seconds = time.perf_counter() - started
        metrics.model_loads.inc(tags={"model": name, "outcome": "loaded"})
        metrics.model_load_seconds.observe(seconds, tags={"model": name})
        logger.info("model %s loaded on demand in %.2f s, %.1f MiB (budget %.1f of %.1f MiB in use)", name, seconds,
                    entry.bytes / 2**20, self.used_bytes() / 2**20, self.budget_bytes / 2**20)

    async def _load_slot(self, entry: Entry) -> None:
        """One of the replica's max_concurrent_loads slots for `entry`'s load: at once when one is free, else after
        waiting (at most LOAD_WAIT_S, MAX_WAITING_LOADS loads at a time) while the slots go to the waiting models
        used most lately first: a hot model evicted on this replica is loaded again ahead of a flood of cold ones.
        Past either bound, 503 with Retry-After."""
        if self.loads_running < self.max_concurrent_loads and not self._waiting:
            self.loads_running += 1
            return
        if len(self._waiting) >= MAX_WAITING_LOADS:
            now = time.monotonic()
            coldest = min(self._waiting, key=lambda w: w[0].uses_at(now), default=None)
            if coldest is None or coldest[0].uses_at(now) >= entry.uses_at(now):
                raise ModelsBusy(f"{self.loads_running} model loads are running on this replica and "
                                 f"{len(self._waiting)} waiting (max_concurrent_loads): retry shortly", retry_after_s=1)
            self._waiting.remove(coldest)  # a hotter model takes the coldest waiter's place
            coldest[1].set_exception(ModelsBusy(f"model {coldest[0].name!r}: loads of models used more lately came "
                                                "first on this replica (max_concurrent_loads): retry shortly",
                                                retry_after_s=1))
        turn: asyncio.Future = asyncio.get_running_loop().create_future()
        waiter = (entry, turn)
        self._waiting.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(turn), LOAD_WAIT_S)
        except asyncio.TimeoutError:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
                raise ModelsBusy(f"model {entry.name!r} waited {LOAD_WAIT_S:.0f} s for one of this replica's "
                                 f"{self.max_concurrent_loads} load slots (max_concurrent_loads): retry shortly",
                                 retry_after_s=1) from None
            await turn  # handed a slot as the wait ended: take it

    def _hand_on_slot(self) -> None:
        """A load ended: its slot to the waiting model used most lately."""
        if self._waiting and self.loads_running < self.max_concurrent_loads:
            now = time.monotonic()
            waiter = max(self._waiting, key=lambda w: w[0].uses_at(now))
            self._waiting.remove(waiter)
            self.loads_running += 1
            waiter[1].set_result(None)

    def _loaded(self, entry: Entry, future: asyncio.Future) -> None:
        entry.loading = None
        if not future.cancelled():
            future.exception()  # seen here: a load whose waiters all timed out is not an unretrieved error
        self._tell_held()

    def _load_blocking(self, entry: Entry) -> Engine:
        engine = self.loader(BundleRef(path=entry.path, name=entry.name))
        engine.runner.warm_up()  # its sessions' arenas allocated now, so the measure holds them
        return engine

    @staticmethod
    def _stamp(entry: Entry) -> float:
        try:
            return (entry.path / BUNDLE_MANIFEST).stat().st_mtime
        except OSError:
            return 0.0

    async def _room_for(self, needed: int, entry: Entry) -> None:
        """_make_room, waiting (at most LOAD_WAIT_S) while it is held by models in use that would make room once
        idle: their requests take milliseconds. A model that landed on a replica busy with others (its request
        spilled over from the one holding it) is loaded there a moment later, not refused."""
        give_up = time.monotonic() + LOAD_WAIT_S
        while True:
            try:
                return self._make_room(needed, entry)
            except ModelsBusy as busy:
                if not busy.in_use or time.monotonic() >= give_up:
                    raise
            await asyncio.sleep(ROOM_POLL_S)

    def _make_room(self, needed: int, entry: Entry) -> None:
        """Unload idle on-demand models, least used lately first (victim_order), until `needed` bytes for `entry` fit
        the budget; 503 when they cannot, and then nothing is unloaded: the models in use hold the room, or those
        that would have to go are used more lately than `entry` (HOTTER_BY times its decayed count of requests, the
        one it is loaded for included), so that a flood of cold models never unloads a hot one."""
        name = entry.name
        if needed > self.budget_bytes:
            raise ModelsBusy(f"model {name!r} needs about {needed / 2**20:.0f} MiB, more than this replica's whole "
                             f"model budget ({self.budget_bytes / 2**20:.0f} MiB, model_memory_bytes)",
                             retry_after_s=30)
        now = time.monotonic()
        wanted = HOTTER_BY * (entry.uses_at(now) + 1.0)
        victims, freed, over = [], 0, self.used_bytes() + needed - self.budget_bytes
        for e in sorted((e for e in self.entries.values() if not e.eager and e.idle() and e.name not in self.kept),
                        key=lambda e: e.victim_order(now)):
            if freed >= over or e.uses_at(now) > wanted:
                break
            victims.append(e)
            freed += e.bytes
        if freed < over:
            busy = ModelsBusy(f"model {name!r} needs about {needed / 2**20:.0f} MiB; this replica's "
                              f"{self.budget_bytes / 2**20:.0f} MiB (model_memory_bytes) hold models in use or used more "
                              "lately: retry shortly", retry_after_s=1)
            busy.in_use = freed + sum(e.bytes for e in self.entries.values() if e.engine is not None and not e.eager
                                      and not e.idle() and e.uses_at(now) <= wanted) >= over
            raise busy
        for e in victims:
            self._unload(e, "memory")

    def _trim(self, keep: Entry) -> None:
        """Unload idle on-demand models but `keep` (just loaded, for a request waiting on it), least used lately
        first and none used more lately than it (as _make_room), while more than the budget is loaded: its first
        load was reckoned at its files' size, and it may measure more."""
        now = time.monotonic()
        wanted = HOTTER_BY * (keep.uses_at(now) + 1.0)
        for e in sorted((e for e in self.entries.values()
                         if not e.eager and e.idle() and e is not keep and e.name not in self.kept),
                        key=lambda e: e.victim_order(now)):
            if self.used_bytes() <= self.budget_bytes or e.uses_at(now) > wanted:
                break
            self._unload(e, "memory")

    def _unload(self, entry: Entry, reason: str) -> None:
        engine = entry.engine
        if engine is None:
            return
        entry.engine = None
        if self.engines.by_name.get(engine.name) is engine:  # (a removed model has left the table already)
            self.engines.remove(engine.name)
        engine.batcher.close()
        self._pending_unload.discard(entry.name)
        service_metrics().model_evictions.inc(tags={"model": entry.name, "reason": reason})
        logger.info("model %s unloaded (%s): %.1f MiB freed", entry.name, reason, entry.bytes / 2**20)
        self._tell_held()
        del engine
        give_back_memory()
        if entry.removed:
            del self.entries[entry.name]

    # ---- the sweeper: idle, removed and asked-to-unload models, once idle ----

    def _start_sweeper(self) -> None:
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def _sweep_forever(self) -> None:
        while True:
            try:
                if self.placement is not None:
                    await self.placement.report(self.held())
                self.sweep()
            except Exception:  # a bug to see in the log, never a reason to stop sweeping
                logger.exception("model repository sweep failed")
            await asyncio.sleep(SWEEP_PERIOD_S)

    def sweep(self) -> None:
        self.scan()
        now = time.monotonic()
        give_way: set[str] = set()
        if self.placement is not None:
            self.kept = {n for n in self.placement.keep() if n in self.entries and not self.entries[n].removed}
            give_way = self.placement.give_way() - self.kept
            for name in self.kept - self._keeping:
                if self.entries[name].engine is None:
                    self._keeping.add(name)
                    asyncio.get_running_loop().create_task(self._keep_loaded(name))
        for entry in list(self.entries.values()):
            if entry.eager or entry.engine is None or not entry.idle() or entry.name in self.kept:
                continue
            if entry.removed:
                self._unload(entry, "removed")
            elif entry.name in self._pending_unload:
                self._unload(entry, "unloaded")
            elif self.idle_unload_s > 0 and now - entry.last_used >= self.idle_unload_s:
                self._unload(entry, "idle")
            elif entry.name in give_way and now - entry.last_used >= GIVE_WAY_IDLE_S:
                self._unload(entry, "moved")

    async def _keep_loaded(self, name: str) -> None:
        """A model kept here for min_loaded, loaded with no request waiting (tried again by the next sweeps)."""
        try:
            await self.ensure(name, LOAD_WAIT_S + KEEP_LOAD_S)
        except ServiceError as exc:
            logger.warning("model %s: not loaded for min_loaded yet: %s", name, exc.message)
        finally:
            self._keeping.discard(name)

    def held(self) -> list[str]:
        """The models a request may find here without waiting for another replica's: loaded, or loading."""
        return sorted(n for n, e in self.entries.items() if not e.removed and (e.engine is not None or e.loading))

    def _tell_held(self) -> None:
        if self.on_held is None:
            return
        held = tuple(self.held())
        if held != self._told:
            self._told = held
            try:
                self.on_held(list(held))
            except Exception:  # routing falls back to any replica, which loads what it is asked for
                logger.warning("could not tell Ray Serve which models this replica holds", exc_info=True)

    def loaded_bytes(self) -> dict[str, int]:
        """Each loaded on-demand model's measured bytes (the loaded-models gauges)."""
        return {n: e.bytes for n, e in self.entries.items() if e.engine is not None and not e.eager}


def default_model_budget(num_cpus: float) -> int:
    """model_memory_bytes left unset: half the node's memory times the replica's share of its CPUs."""
    import psutil

    share = min(1.0, num_cpus / (os.cpu_count() or 1)) if num_cpus > 0 else 1.0 / (os.cpu_count() or 1)
    return int(psutil.virtual_memory().total * 0.5 * share)
