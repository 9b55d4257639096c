"""Bridges that share the work (``ingest.sharded``): every live bridge owns a disjoint set of targets
(vLLM pods, Mooncake masters), so ingest capacity grows with the number of bridges.

- Membership: each bridge keeps a key ``member.<holder>`` in the lease bucket (whose TTL is the lease
  TTL) fresh; the live bridges are the keys present.
- Placement: rendezvous hashing of each target over the live bridges; every bridge computes the same
  owner, and when a bridge joins or leaves only its own share moves.
- Exclusion: a bridge publishes for a target only while it holds the target's lease ``own.<target>``
  (created by one holder only, renewed by revision, gone after the TTL when the holder dies). A target
  that moves is stopped and released by its old owner before the new one can take it; the new owner
  resumes it from the stream (bridge/vllm_subscriber.py: replay of the gap, no reset).
- Removals: a target that left stays wanted until its removal is on the stream, so that its lease
  holder, whichever bridge that is by then, publishes it (bridge/removals.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from cache_indexer.infra.streams import kv_bucket, subject_token
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning

log = logging.getLogger(__name__)

MEMBER = "member."
OWN = "own."


def owner(target: str, members: list[str]) -> str:
    """The rendezvous (highest random weight) owner of ``target`` among ``members``."""
    return max(members, key=lambda m: hashlib.blake2b(f"{target}\0{m}".encode(), digest_size=8).digest())


class ShardLeases:
    def __init__(self, js, bucket: str, holder: str, ttl: float, replicas: int,
                 on_owned: Callable[[set[str]], Awaitable[None]], metrics=None) -> None:
        self.js = js
        self.bucket = bucket
        self.holder = holder
        self.ttl = ttl
        self.replicas = replicas
        self.on_owned = on_owned  # called with the targets owned, after every change
        self._told: set[str] | None = set()  # what on_owned last took (None: its last call failed)
        self.wanted: set[str] = set()  # every target discovery lists now
        self.owned: dict[str, int] = {}  # target -> revision of its lease
        self.members: list[str] = [holder]
        self._kv = None
        self._task: asyncio.Task | None = None
        self._poke = asyncio.Event()
        self._failed = ThrottledWarning(log)
        self._tell_failed = ThrottledWarning(log, level=logging.ERROR)  # retried every ttl/4
        self._errors = metrics.task_errors.labels("shard-leases") if metrics is not None else None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="bridge-shards")

    def want(self, targets: set[str]) -> None:
        """What discovery lists now; placement follows at once."""
        self.wanted = set(targets)
        self._poke.set()

    def is_owner(self, target: str) -> bool:
        """Whether this bridge is the target's place among the live bridges (held or not)."""
        return owner(target, self.members) == self.holder

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait(self._task)
        kv = self._kv
        for target, rev in list(self.owned.items()):  # hand over at once instead of after the TTL
            await self._release(target, rev)
        if kv is not None:
            try:
                await kv.delete(MEMBER + self.holder)
            except Exception:
                pass

    async def _loop(self) -> None:
        while True:
            try:
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS away, typically: once per ttl/4 until it is back, so throttled
                self._count()
                self._failed("shard leases: a round failed (%s: %s); the targets owned are kept until their TTL",
                             type(exc).__name__, exc)
            try:
                await asyncio.wait_for(self._poke.wait(), self.ttl / 4)
            except asyncio.TimeoutError:
                pass
            self._poke.clear()

    async def _round(self) -> None:
        if self._kv is None:
            self._kv = await kv_bucket(self.js, self.bucket, self.replicas, ttl=self.ttl, history=1)
        kv = self._kv
        await kv.put(MEMBER + self.holder, b"1")
        self.members = sorted(await self._live_members() | {self.holder})
        before = set(self.owned)
        mine = {t for t in self.wanted if self.is_owner(t)}
        gone = {t: self.owned.pop(t) for t in list(self.owned) if t not in mine}  # moved or gone
        told = not gone or await self._tell()
        if gone and told:  # stopped first, then released (else not renewed: they expire after the TTL)
            for target, rev in gone.items():
                await self._release(target, rev)
        for target, rev in list(self.owned.items()):
            try:
                self.owned[target] = await kv.update(OWN + subject_token(target), self.holder.encode(), last=rev)
            except KeyWrongLastSequenceError:  # expired and taken meanwhile: no longer ours
                log.warning("shard lease of %s lost", target)
                del self.owned[target]
        for target in sorted(mine - set(self.owned)):
            try:
                self.owned[target] = await kv.create(OWN + subject_token(target), self.holder.encode())
            except KeyWrongLastSequenceError:
                pass  # the previous owner has not released it yet, or died: its TTL runs out
        if set(self.owned) != before:
            log.info("bridge %s owns %d of %d targets (%d bridges)", self.holder, len(self.owned), len(self.wanted),
                     len(self.members))
        if told and set(self.owned) != self._told:
            await self._tell()

    async def _tell(self) -> bool:
        """on_owned with the targets owned now. A failure is logged, counted and tried again next round
        (by then nothing else changes, so nothing else would call it), the round goes on: the leases
        owned are renewed meanwhile."""
        try:
            await self.on_owned(set(self.owned))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._told = None  # what it did of it is unknown: the next round calls it whatever changed
            self._count()
            self._tell_failed("shard leases: following the %d targets owned failed (%s: %s); tried again next "
                              "round", len(self.owned), type(exc).__name__, exc, exc_info=True)
            return False
        self._told = set(self.owned)
        return True

    def _count(self) -> None:
        if self._errors is not None:
            self._errors.inc()

    async def _live_members(self) -> set[str]:
        """The member keys present (a watch of ``member.>`` alone: the bucket also holds a lease per
        target, which listing every key would read each round)."""
        watcher = await self._kv.watch(MEMBER + ">", ignore_deletes=True, meta_only=True)

        async def present() -> set[str]:
            found = set()
            async for entry in watcher:
                if entry is None:  # the present values are all in
                    break
                found.add(entry.key[len(MEMBER):])
            return found
        try:  # bounded: a marker that never comes fails this round (retried), not the bridge's placement
            return await asyncio.wait_for(present(), max(self.ttl, 1.0))
        finally:
            await watcher.stop()

    async def _release(self, target: str, rev: int) -> None:
        try:
            await self._kv.delete(OWN + subject_token(target), last=rev)
        except (KeyWrongLastSequenceError, KeyNotFoundError):
            pass
        except Exception as exc:
            log.warning("shard lease of %s not released (%s): it expires after the TTL", target, exc)
