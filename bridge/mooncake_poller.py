"""Polls one Mooncake Master and publishes what changed in L3 as (block hash, pod) pairs.

Each poll lists the keys, asks where only the keys that are new since the last poll live (so the work
grows with the change, apart from the key listing itself, which the API offers only whole). A replica
counts while its segment is mounted: replicas on a segment the master stops listing are dropped, and
come back, without asking the master again, when it lists the segment again. Pairs are reference-counted (several keys,
e.g. the TP ranks of one block, map to the same pair), so only 0 <-> 1 transitions are published:
``l3_diff`` messages, and every ``fullStateEvery`` polls an ``l3_full`` with ``Nats-Rollup: sub`` that
compacts the master's subject to one message. A failed poll (timeout, HTTP error, malformed body) is
counted and publishes nothing: the previous state stands until a poll succeeds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import aiohttp

from bridge.mooncake_keys import KeyParser
from bridge.mooncake_master import MasterClient, MasterError, endpoint_host
from cache_indexer.metrics import Metrics
from cache_indexer.tasks import cancel_and_wait
from schemas.config import L3IngestConfig

log = logging.getLogger(__name__)


def poll_error_reason(exc: BaseException) -> str:
    """The label of cache_indexer_l3_poll_errors_total."""
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientError):
        return "connection"
    if isinstance(exc, MasterError):
        return "malformed"
    return "internal"


def describe(exc: BaseException) -> str:
    """Never an empty reason (a timeout's str() is empty)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


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
        self.key_hosts: dict[str, set[str]] = {}  # key -> hosts of its replicas, live segments or not
        self.live_hosts: set[str] = set()  # hosts with a mounted segment at the last poll
        self.key_hash: dict[str, int] = {}
        self.pairs: Counter[tuple[str, int]] = Counter()
        self.ignored: set[str] = set()  # keys without a usable block hash (counted once)
        self.polls = 0
        self.last_poll_seconds = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"mooncake-poll-{self.target.name}")
        self._task.add_done_callback(self._restart_if_it_died)

    def _restart_if_it_died(self, task: asyncio.Task) -> None:
        """The loop catches every Exception; should it end anyway, L3 must not freeze silently."""
        if self._stopping or task.cancelled():
            return
        self.metrics.l3_poller_restarts.inc()
        log.error("mooncake master %s: the poller ended (%r); restarting it", self.target.name, task.exception())
        self.start()

    async def stop(self, reset: bool = False) -> None:
        self._stopping = True
        if self._task:
            await cancel_and_wait(self._task)
        if reset:  # the master is gone: its entries can no longer be vouched for
            await self.sink.full(self.target.name, {})

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any one poll's failure: counted, logged, the next poll runs
                reason = poll_error_reason(exc)
                self.metrics.l3_poll_errors.labels(reason).inc()
                log.warning("mooncake master %s: poll failed (%s: %s); keeping the previous state",
                            self.target.name, reason, describe(exc))
            await asyncio.sleep(self.cfg.pollInterval)

    async def poll(self) -> None:
        t = time.perf_counter()
        keys = await self.client.all_keys()
        live_hosts = {endpoint_host(s) for s in await self.client.segments()}
        listed = set(keys)
        self.ignored &= listed
        new = [k for k in keys if k not in self.key_hosts and k not in self.ignored and self._hash(k) is not None]
        located = await self.client.locate(new)
        added: dict[str, list[int]] = {}
        removed: dict[str, list[int]] = {}

        def add(host: str, h: int) -> None:
            self.pairs[(host, h)] += 1
            if self.pairs[(host, h)] == 1:
                added.setdefault(host, []).append(h)

        def drop(host: str, h: int) -> None:
            self.pairs[(host, h)] -= 1
            if self.pairs[(host, h)] == 0:
                del self.pairs[(host, h)]
                removed.setdefault(host, []).append(h)

        for key in [k for k in self.key_hosts if k not in listed]:
            for host in self.key_hosts.pop(key) & self.live_hosts:
                drop(host, self.key_hash[key])
            del self.key_hash[key]
        if live_hosts != self.live_hosts:  # segments unmounted or (re)mounted: known keys follow them
            gone, back = self.live_hosts - live_hosts, live_hosts - self.live_hosts
            for key, hosts in self.key_hosts.items():
                for host in hosts & gone:
                    drop(host, self.key_hash[key])
                for host in hosts & back:
                    add(host, self.key_hash[key])
        self.live_hosts = live_hosts
        for key, hosts in located.items():
            if hosts is None or key not in self.key_hash:
                continue  # vanished between listing and locating: the next poll sees it gone
            h = self.key_hash[key]
            self.key_hosts[key] = hosts
            for host in hosts & live_hosts:
                add(host, h)
        for key in new:  # parsed but no longer there: forget the hash
            if key not in self.key_hosts:
                self.key_hash.pop(key, None)
        self.polls += 1
        if self.polls == 1 or self.polls % self.cfg.fullStateEvery == 0:
            state: dict[str, list[int]] = {}
            for host, h in self.pairs:
                state.setdefault(host, []).append(h)
            await self.sink.full(self.target.name, state)
        elif added or removed:
            await self.sink.diff(self.target.name, added, removed)
        self.last_poll_seconds = time.perf_counter() - t
        self.metrics.l3_keys.labels(self.target.name).set(len(self.key_hosts))
        self.metrics.l3_poll_seconds.observe(self.last_poll_seconds)

    def _hash(self, key: str) -> int | None:
        h = self.key_hash.get(key)
        if h is None:
            h = self.parser.block_hash(key)
            if h is None:
                self.metrics.l3_unparsed_keys.inc()
                self.ignored.add(key)
                return None
            self.key_hash[key] = h
        return h
