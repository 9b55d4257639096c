"""Removals that sharded bridges (``ingest.sharded``) cannot skip: a pod that left discovery (after
``ingest.l1.removalGrace``), a rank gone from a pod still listed, a Mooncake master that is gone.

Each removal is published by one bridge, but it must not depend on any one bridge staying alive: a
pod whose owner died (or was stopping) when the pod left would otherwise be answered for ever, also
for a new pod that gets its IP. So every live bridge, all seeing the same discovery, keeps each
removal pending, and keeps its shard (``pod:<ip>`` for pods and ranks, ``master:<name>``) among the
shards it wants (bridge/shard_leases.py), until the stream shows the removal done:

- a pod: the last message on any of its subjects (``<prefix>.<pod>.*``) is a ``pod_removed``;
- a rank: the last message on its subject is a ``rank_removed``, or the pod's is a ``pod_removed``;
- a master: the last message on its L3 subject is a whole full state without pods.

Only the bridge holding the shard's lease publishes it, as for the shard's batches: the lease makes one
publisher of a pod at a time, so a removal can never follow a newer generation of a pod that came back
(that order is what its holder saw). A dead owner's lease runs out after ``nats.lease.ttl`` (a stopping
one releases it), the next owner among the bridges still renewing theirs takes it, finds the removal
not on the stream and publishes it. The holder publishes it again while the stream does not show it
(its publish went with a connection that broke), at most once per ``nats.lease.ttl``; the message id
names the stream sequence of the last message it follows (``<pod>:removed:after:<seq>``; with nothing
of the target left on the stream, the last one purged), so repeats of one removal are one message for
JetStream, and a repeat that lands anyway (a late batch of the
retired generation stored in between) retires what is already retired. A target listed again cancels
its pending removal (a pod back after its removal was published starts a new generation:
bridge/l1_publisher.py, ``last_position``).

Left as is: a bridge that misses the removal on the stream (purged behind a snapshot before it looked,
``snapshot.purgeKeep`` newer messages within ``nats.lease.ttl / 4``) keeps it pending, which costs a
read of the stream every ``nats.lease.ttl / 4``, until it holds the shard itself and publishes it again.

The bridge that is not sharded publishes at once instead (bridge/service.py): it is the only publisher.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.js.errors import NotFoundError

from cache_indexer.bridge.l1_publisher import L1Publisher
from cache_indexer.bridge.l3_publisher import L3Publisher
from cache_indexer.infra.event_codec import decode
from cache_indexer.infra.streams import l1_pod_subjects, l1_subject, l3_subject
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.config import NatsConfig

log = logging.getLogger(__name__)

#: Shard targets: a vLLM pod (its IP) or a Mooncake master (its name).
POD, MASTER = "pod:", "master:"
#: What is removed.
KINDS = ("pod", "rank", "master")


@dataclass(slots=True)
class Removal:
    kind: str  # "pod", "rank" or "master"
    name: str  # the pod, or the master
    rank: int = -1  # the rank, for a rank
    reason: str = "discovery"
    check_at: float = 0.0  # when the stream is looked at next
    sent_at: float = float("-inf")  # when this bridge last published it

    @property
    def shard(self) -> str:
        return (MASTER if self.kind == "master" else POD) + self.name


class PendingRemovals:
    def __init__(self, js, nats: NatsConfig, l1: L1Publisher, l3: L3Publisher, holds: Callable[[str], bool],
                 check_every: float, publish_every: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._js = js
        self._nats = nats
        self._l1 = l1
        self._l3 = l3
        self._holds = holds  # whether this bridge holds a shard's lease
        self.check_every = check_every
        self.publish_every = publish_every
        self._clock = clock
        self.pending: dict[tuple[str, str, int], Removal] = {}
        self._failed = ThrottledWarning(log)

    def add(self, kind: str, name: str, rank: int = -1, reason: str = "discovery") -> None:
        self.pending.setdefault((kind, name, rank), Removal(kind, name, rank, reason))

    def cancel(self, kind: str, name: str, rank: int = -1) -> bool:
        """The target is listed again: not removed (True: it was pending)."""
        return self.pending.pop((kind, name, rank), None) is not None

    def names(self, kind: str) -> set[str]:
        return {r.name for r in self.pending.values() if r.kind == kind}

    def shards(self) -> set[str]:
        return {r.shard for r in self.pending.values()}

    def due(self) -> bool:
        now = self._clock()
        return any(r.check_at <= now for r in self.pending.values())

    def clear(self) -> None:
        self.pending.clear()

    async def settle(self) -> list[Removal]:
        """Looks at the stream for the removals due: those it shows are done (returned, and no longer
        pending); those of shards this bridge holds are published. The caller holds what keeps the
        targets from changing meanwhile (a target listed again must not be removed after all)."""
        done = []
        for key, r in list(self.pending.items()):
            if r.check_at > self._clock():
                continue
            try:
                after, shown = await self._last(r)
                if shown:
                    del self.pending[key]
                    done.append(r)
                    continue
                if self._holds(r.shard) and self._clock() - r.sent_at >= self.publish_every:
                    await self._publish(r, after)
                    r.sent_at = self._clock()
            except Exception as exc:  # NATS away, typically: looked at again after check_every
                self._failed("pending removal of %s %s: %s: %s (tried again)", r.kind, r.name, type(exc).__name__, exc)
            r.check_at = self._clock() + self.check_every
        return done

    async def _last(self, r: Removal) -> tuple[int, bool]:
        """(the stream sequence of the last message the removal follows, 0 for none; whether it is done)."""
        l1, l3 = self._nats.l1Stream, self._nats.l3Stream
        if r.kind == "master":
            msg = await self._last_msg(l3.name, l3_subject(l3.subjectPrefix, r.name))
            return (await self._purged(l3.name), False) if msg is None else (msg.seq, _empty_full_state(msg))
        pod = await self._last_msg(l1.name, l1_pod_subjects(l1.subjectPrefix, r.name))
        if r.kind == "pod":
            return (await self._purged(l1.name), False) if pod is None else (pod.seq, _kind(pod) == "pod_removed")
        if pod is not None and _kind(pod) == "pod_removed":
            return pod.seq, True
        msg = await self._last_msg(l1.name, l1_subject(l1.subjectPrefix, r.name, r.rank))
        return (await self._purged(l1.name), False) if msg is None else (msg.seq, _kind(msg) == "rank_removed")

    async def _purged(self, stream: str) -> int:
        """With nothing of the target on the stream, the last message the removal follows is the last one
        purged: an earlier removal of the same target, since purged too, followed an earlier one (0 for
        both would make them one message id, and JetStream would drop the later one as a duplicate)."""
        info = await self._js.stream_info(stream)
        return max(0, info.state.first_seq - 1)

    async def _last_msg(self, stream: str, subject: str):
        try:
            return await self._js.get_last_msg(stream, subject)
        except NotFoundError:
            return None

    async def _publish(self, r: Removal, after: int) -> None:
        if r.kind == "pod":
            await self._l1.pod_removed(r.name, r.reason, after=after)
        elif r.kind == "rank":
            await self._l1.rank_removed(r.name, r.rank, r.reason, after=after)
        else:
            await self._l3.gone(r.name, after=after)
        log.info("%s %s%s removed (%s), after stream message %d", r.kind, r.name,
                 f" rank {r.rank}" if r.kind == "rank" else "", r.reason, after)


def _kind(msg) -> str | None:
    return (msg.headers or {}).get("Kv-Type")


def _empty_full_state(msg) -> bool:
    if _kind(msg) != "l3_full" or (msg.headers or {}).get("Kv-Part", "1/1") != "1/1":
        return False
    try:
        return not decode(msg.data).get("pods")
    except Exception:
        return False
