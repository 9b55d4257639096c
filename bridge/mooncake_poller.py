"""Polls one Mooncake Master and publishes what changed in L3 as (block hash, pod) pairs.

Each poll lists the keys and segments, then asks (read-only ``/batch_query_keys``) where these keys
live: the keys new since the last poll; the known keys on a host whose segment appeared, vanished or
re-registered (the master may have dropped their replicas, or a new client may have mounted with a dead
one's IP); and a rolling slice of all known keys, so that each is asked about again within
``relocateEvery`` (a key removed and put again on another pod between two polls is listed both times:
only asking again finds it moved). A replica counts while its segment is mounted. Pairs are
reference-counted (several keys, e.g. the TP ranks of one block, map to the same pair), so only
0 <-> 1 transitions are published: ``l3_diff`` messages, and every ``fullStateEvery`` polls an
``l3_full`` with ``Nats-Rollup: sub`` that compacts the master's subject. A failed poll (timeout, HTTP
error, malformed body, anything) is counted and publishes nothing: the previous state stands until a
poll succeeds. The work over keys runs in slices between yields to the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from itertools import islice

import aiohttp

from cache_indexer.bridge.l3_publisher import NotAcknowledged
from cache_indexer.bridge.mooncake_keys import KeyParser
from cache_indexer.bridge.mooncake_master import MasterClient, MasterError, endpoint_host
from cache_indexer.infra.pauser import Pauser
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.schemas.config import L3IngestConfig

log = logging.getLogger(__name__)


def poll_error_reason(exc: BaseException) -> str:
    """The label of cache_indexer_l3_poll_errors_total."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientError):
        return "connection"
    if isinstance(exc, MasterError):
        return "malformed"
    if isinstance(exc, NotAcknowledged):
        return "publish"
    return "internal"


def describe(exc: BaseException) -> str:
    """Never an empty reason (a timeout's str() is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


#: Keys handled between two looks at the clock: a 300k-key poll runs in pieces of a few milliseconds
#: (infra/pauser.py), between which the API answers.
_SLICE = 256


async def _select(items, wanted, pause: Pauser) -> list:
    """The items ``wanted`` accepts, taken a slice at a time without copying ``items`` (which must not
    change meanwhile)."""
    out: list = []
    it = iter(items)
    while chunk := list(islice(it, _SLICE)):
        out.extend(filter(wanted, chunk))
        await pause()
    return out


def _hosts(joined: str) -> list[str]:
    return joined.split(",") if joined else []


class _Delta:
    """Reference-counted (host, block) pairs: only 0 <-> 1 transitions are published, and a pair that
    goes and comes back within one poll is no change at all."""

    def __init__(self, pairs: dict[str, dict[int, int]]) -> None:
        self.pairs = pairs
        self._added: set[tuple[str, int]] = set()
        self._removed: set[tuple[str, int]] = set()

    def add(self, host: str, h: int) -> None:
        held = self.pairs.setdefault(host, {})
        n = held.get(h, 0) + 1
        held[h] = n
        if n == 1:
            if (host, h) in self._removed:
                self._removed.discard((host, h))
            else:
                self._added.add((host, h))

    def drop(self, host: str, h: int) -> None:
        held = self.pairs[host]
        n = held[h] - 1
        if n:
            held[h] = n
            return
        del held[h]
        if not held:
            del self.pairs[host]
        if (host, h) in self._added:
            self._added.discard((host, h))
        else:
            self._removed.add((host, h))

    def net(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        added: dict[str, list[int]] = {}
        removed: dict[str, list[int]] = {}
        for host, h in self._added:
            added.setdefault(host, []).append(h)
        for host, h in self._removed:
            removed.setdefault(host, []).append(h)
        return added, removed


@dataclass(frozen=True, slots=True)
class MasterTarget:
    name: str  # stable identity (pod name or configured name)
    url: str  # http://host:port of the admin port


class MooncakePoller:
    def __init__(self, target: MasterTarget, cfg: L3IngestConfig, sink, metrics: Metrics,
                 session: aiohttp.ClientSession, segments_timeout: float | None = None) -> None:
        self.target = target
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self.client = MasterClient(target.url, session, cfg.httpTimeout, cfg.batchKeys, cfg.concurrency,
                                   segments_timeout=segments_timeout, max_bytes=cfg.maxResponseBytes)
        self.parser = KeyParser(cfg.keyFormats, cfg.extraKeyPatterns)
        # What lives as long as the poller is kept in maps of strings and ints, which the garbage collector
        # does not track, and a steady poll builds no container of every key (the listing is consumed as
        # it streams in): 100k-entry sets and tuples made each collection take 20-130 ms of the loop.
        self.key_hosts: dict[str, str] = {}  # key -> hosts of its replicas ("," joined), live or not
        self.key_hash: dict[str, int] = {}
        self._seen: dict[str, int] = {}  # key -> the last listing that showed it
        self._listing = 0
        self.live_hosts: set[str] = set()  # hosts with a mounted segment at the last poll
        self.pairs: dict[str, dict[int, int]] = {}  # host -> {block hash: keys holding it there}
        self.ignored: dict[str, int] = {}  # keys without a usable block hash (counted once) -> last listing
        self.live_segments: set[str] = set()  # segment names at the last poll
        self._recheck: tuple[str, ...] = ()  # the keys of this round of relocateEvery
        self._recheck_at = 0
        self.polls = 0
        self.last_poll_seconds = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._loop(), name=f"mooncake-poll-{self.target.name}")
        self._task.add_done_callback(self._restart_if_it_died)

    def _restart_if_it_died(self, task: asyncio.Task) -> None:
        """The loop catches every Exception; should it end anyway, L3 must not freeze silently."""
        if self._stopping or task.cancelled():
            return
        self.metrics.l3_poller_restarts.inc()
        log.error("mooncake master %s: the poller ended (%r); restarting it", self.target.name, task.exception(),
                  extra={"master": self.target.name})
        self.start()

    def start_over(self) -> None:
        """The stream lost what was published: the next poll publishes the full state."""
        self.polls = 0

    async def stop(self, reset: bool = False) -> None:
        self._stopping = True
        if self._task:
            await cancel_and_wait(self._task)
        if reset:  # the master is gone: its entries can no longer be vouched for
            await self.sink.full(self.target.name, {})

    async def _loop(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any one poll's failure: counted, logged, the next poll runs
                reason = poll_error_reason(exc)
                self.metrics.l3_poll_errors.labels(reason).inc()
                log.warning("mooncake master %s: poll failed (%s: %s); keeping the previous state",
                            self.target.name, reason, describe(exc), extra={"master": self.target.name})
            await asyncio.sleep(self.cfg.pollInterval)

    async def poll(self) -> None:
        """List, locate, then update: nothing is changed before every answer of the master is in, so a
        poll that fails leaves the previous state exactly as it was published."""
        t = time.perf_counter()
        pause = Pauser()
        self._listing += 1
        mark = self._listing
        known, seen, ignored = self.key_hosts, self._seen, self.ignored
        new: list[str] = []
        new_hash: dict[str, int] = {}

        def consume(lines: list[str]) -> None:  # one chunk of the listing, as it arrives
            for k in lines:
                if k in known:
                    seen[k] = mark
                elif k in ignored:
                    ignored[k] = mark
                elif k not in new_hash:
                    h = self._parse(k, mark)
                    if h is not None:
                        new_hash[k] = h
                        new.append(k)
        await self.client.all_keys(consume)
        host_of = {s: h for s in await self.client.segments() if (h := endpoint_host(s)) is not None}
        segments, live_hosts = set(host_of), set(host_of.values())
        # a segment that appeared, vanished or re-registered (same host, another name): the master may
        # have dropped or kept the replicas on it, so the known keys on its host are asked about again
        changed_hosts = {endpoint_host(s) for s in segments ^ self.live_segments} & live_hosts

        def listed(k: str) -> bool:
            return seen.get(k) == mark

        relocate: list[str] = []
        if changed_hosts:
            relocate = await _select(known, lambda k: listed(k) and not changed_hosts.isdisjoint(_hosts(known[k])),
                                     pause)
        rolling = self._rolling(lambda k: listed(k) and changed_hosts.isdisjoint(_hosts(known[k])))
        gone_keys = await _select(known, lambda k: not listed(k), pause)
        asked = new + relocate + rolling
        located = await self.client.locate(asked)
        self.metrics.l3_batch_query.labels(self.target.name).set(0 if self.client.batch_supported is False else 1)
        self.metrics.l3_relocated_keys.labels("segment").inc(len(relocate))
        self.metrics.l3_relocated_keys.labels("rolling").inc(len(rolling))

        delta = _Delta(self.pairs)
        if any(m != mark for m in ignored.values()):  # keys no longer listed are forgotten
            self.ignored = {k: m for k, m in ignored.items() if m == mark}
        for i, key in enumerate(gone_keys):  # in slices too: a master back empty drops every key at once
            if i % _SLICE == 0:
                await pause()
            h = self.key_hash.pop(key)
            seen.pop(key, None)
            for host in _hosts(known.pop(key)):
                if host in self.live_hosts:
                    delta.drop(host, h)
        await pause()
        gone, back = self.live_hosts - live_hosts, live_hosts - self.live_hosts
        moved = gone | back
        if moved:  # known replicas follow their segment out and back (and are asked about again)
            for i, key in enumerate(await _select(known, lambda k: not moved.isdisjoint(_hosts(known[k])), pause)):
                if i % _SLICE == 0:
                    await pause()
                for host in _hosts(known[key]):
                    if host in gone:
                        delta.drop(host, self.key_hash[key])
                    elif host in back:
                        delta.add(host, self.key_hash[key])
        self.live_hosts, self.live_segments = live_hosts, segments
        for i, key in enumerate(asked):
            if i % _SLICE == 0:
                await pause()
            hosts = located.get(key, ...)
            if hosts is ...:  # not answered (asked again next poll), or a "," key the read-only endpoint cannot take
                if "," in key and key not in known:
                    self.metrics.l3_unlocatable_keys.inc()
                    self.ignored[key] = mark
                continue
            h = self.key_hash.pop(key, None)
            h = new_hash[key] if h is None else h
            for host in _hosts(known.pop(key, "")):
                if host in live_hosts:
                    delta.drop(host, h)
            seen.pop(key, None)
            if hosts is None:  # gone between listing and locating: the next poll sees it gone
                continue
            known[key] = ",".join(sorted(hosts))
            self.key_hash[key] = h
            seen[key] = mark
            for host in hosts:
                if host in live_hosts:
                    delta.add(host, h)
        self.polls += 1
        try:
            if self.polls == 1 or self.polls % self.cfg.fullStateEvery == 0:
                await self.sink.full(self.target.name, {host: list(held) for host, held in self.pairs.items() if held})
            else:
                added, removed = delta.net()
                if added or removed:
                    await self.sink.diff(self.target.name, added, removed)
        except BaseException:  # the state above is ahead of what was published: the next poll sends it whole
            self.start_over()
            raise
        self.last_poll_seconds = time.perf_counter() - t
        self.metrics.l3_keys.labels(self.target.name).set(len(known))
        self.metrics.l3_poll_seconds.observe(self.last_poll_seconds)

    def _rolling(self, wanted) -> list[str]:
        """The next slice of the rolling re-check: every known key once per ``relocateEvery``, spread over
        the polls of that period (the poll's own duration counts), at most ``relocateMaxKeys`` a poll."""
        if not self.cfg.relocateEvery or not self.key_hosts or not self.cfg.relocateMaxKeys:
            return []
        period_polls = self.cfg.relocateEvery / (self.cfg.pollInterval + self.last_poll_seconds)
        want = min(self.cfg.relocateMaxKeys, max(1, math.ceil(len(self.key_hosts) / max(period_polls, 1.0))))
        out: list[str] = []
        while len(out) < want:
            if self._recheck_at >= len(self._recheck):
                if self._recheck:  # a whole round done: the next one starts next poll
                    self._recheck = ()
                    break
                self._recheck, self._recheck_at = tuple(self.key_hosts), 0  # a tuple: not tracked by the GC
                if not self._recheck:
                    break
            key = self._recheck[self._recheck_at]
            self._recheck_at += 1
            if key in self.key_hosts and wanted(key):
                out.append(key)
        return out

    def _parse(self, key: str, mark: int) -> int | None:
        h = self.parser.block_hash(key)
        if h is None:  # counted once: the key is ignored until it leaves the listing
            self.metrics.l3_unparsed_keys.inc()
            self.ignored[key] = mark
        return h
