"""What the active bridge publishes for, kept in the records bucket (``infra.streams.records_bucket``,
``snapshot.metaBucket``; key ``bridge.targets``): the vLLM pods it subscribes to and the Mooncake
masters it polls, and the endpoints of those pods (where they came from: the API's ``/workers``).
Written by the bridge, read by the bridge that takes over and by the API.

Pods and masters that leave discovery are dropped from the index through the streams, but only by a
bridge that sees them leave. One that left while no bridge watched (all were down, or a standby was
taking over) would stay in the index for ever. A bridge that starts leading reads the record and
treats what it lists as known, so its first discovery result removes what has gone since. Pods and
DP ranks whose removal is not on the stream yet stay in it (``pods``; ``removing`` for ranks of pods
still listed): a bridge killed with a removal in flight would otherwise leave them indexed for ever, as
the next one would not know they were listed (sharded bridges: also removals pending, bridge/removals.py).
``removing`` also holds the ranks of the pods in their ``ingest.l1.removalGrace``: one back within it
with fewer ranks, under the next bridge, has the others removed.
"""

from __future__ import annotations

import logging

import msgpack
from nats.js.errors import KeyNotFoundError, NotFoundError

from cache_indexer.infra.streams import RecordsKv

log = logging.getLogger(__name__)

KEY = "bridge.targets"


class TargetsRecord:
    def __init__(self, js, bucket: str, replicas: int = 1) -> None:
        self.store = RecordsKv(js, bucket, replicas)  # the records bucket (the bridge's other records go there too)
        self._pods: set[str] | None = None
        self._masters: set[str] | None = None
        self._endpoints: list[list] | None = None
        self._removing: list[list] | None = None

    async def load(self) -> tuple[set[str], set[str]]:
        """(pods, masters) as last saved; empty when there is no record or it cannot be read."""
        try:
            entry = await (await self.store()).get(KEY)
            record = msgpack.unpackb(entry.value) if entry.value else {}
            pods, masters = set(record.get("pods", ())), set(record.get("masters", ()))
        except (KeyNotFoundError, NotFoundError):
            pods, masters = set(), set()
        except Exception as exc:  # unreadable: nothing is inherited, which is what happened before records
            log.warning("bridge targets record unreadable (%s): pods that left meanwhile stay indexed", exc)
            pods, masters = set(), set()
        self._pods, self._masters = set(pods), set(masters)
        return pods, masters

    async def save(self, pods: set[str] | None = None, masters: set[str] | None = None,
                   endpoints: list | None = None, removing: set[tuple[str, int]] | None = None) -> None:
        """Replace the pods (with their endpoints and the (pod, rank) whose removal is not stored yet) and/or
        the masters; written only when something changed."""
        new_pods = self._pods if pods is None else set(pods)
        new_masters = self._masters if masters is None else set(masters)
        new_endpoints = self._endpoints if endpoints is None else sorted(
            ([e.pod, e.rank, e.pub, e.replay, e.name] for e in endpoints), key=lambda row: (row[0], row[1], row[2]))
        new_removing = self._removing if removing is None else sorted([pod, rank] for pod, rank in removing)
        if (new_pods == self._pods and new_masters == self._masters and new_endpoints == self._endpoints
                and new_removing == self._removing):
            return
        value = msgpack.packb({"pods": sorted(new_pods or ()), "masters": sorted(new_masters or ()),
                               "endpoints": new_endpoints or [], "removing": new_removing or []})
        try:
            await (await self.store()).put(KEY, value)
        except Exception as exc:
            log.warning("bridge targets record not written (%s)", exc)
            return
        self._pods, self._masters, self._endpoints, self._removing = new_pods, new_masters, new_endpoints, new_removing


async def read_endpoints(store: RecordsKv) -> list[list] | None:
    """The endpoints the active bridge last recorded ([pod, rank, pub, replay, name]); None: no record."""
    try:
        entry = await (await store()).get(KEY)
    except (KeyNotFoundError, NotFoundError):
        return None
    record = msgpack.unpackb(entry.value) if entry.value else {}
    return [list(e) for e in record.get("endpoints", ())]


async def read_ranks(store: RecordsKv) -> list[list] | None:
    """[pod, rank] of every DP rank the active bridge last recorded: listed, of a pod in its grace, or
    removed with the removal not stored yet; None: no record."""
    try:
        entry = await (await store()).get(KEY)
    except (KeyNotFoundError, NotFoundError):
        return None
    record = msgpack.unpackb(entry.value) if entry.value else {}
    return [list(e[:2]) for e in record.get("endpoints", ())] + [list(e[:2]) for e in record.get("removing", ())]
