"""L3 stream messages: per Mooncake master, diffs and periodic full states (with Nats-Rollup: sub).

A state of any size is published: a message over the limit (the server's ``max_payload``, the stream's
``maxMsgSize``) is split into parts that each fit. A diff's parts are independent (the poller nets each
pair to one transition, so their order does not matter). A full state's parts share a generation
``gen`` and carry ``part``/``parts``; the first carries ``Nats-Rollup: sub``, which leaves just this
full state (and what follows it) on the subject, and the indexer replaces the master's state only when
the last part is in: readers never see half a state.

Every message carries this publisher's ``origin`` (a generation number, new with each bridge) and a
per-master ``seq``, one more for each diff part and one for a whole full state, so that indexers apply
a master's diffs in order and refuse a repeat (indexer/l3_state.py). A message the stream refuses for
good is told to ``on_refused`` with the master's name: the poller then publishes the full state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
from cache_indexer.bridge.l1_publisher import new_generation
from cache_indexer.infra.event_codec import MSGPACK, Codec
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.streams import l3_subject
from cache_indexer.schemas.events import CONTENT_TYPE_L3, SCHEMA_VERSION

log = logging.getLogger(__name__)

#: Upper bound of the envelope (type, master, gen, part, parts, origin, seq) in either encoding, the
#: master's name counted apart; a pod key's with its list's is the codec's ``key_bytes``.
_ENVELOPE_BYTES = 192


def split_pods(pods: dict[str, list[int]], budget: int, codec: Codec = MSGPACK) -> list[dict[str, list[int]]]:
    """``pods`` cut into maps of at most ``budget`` encoded bytes each (at least one map, maybe empty)."""
    parts: list[dict[str, list[int]]] = [{}]
    room = budget
    hash_bytes = codec.hash_bytes
    for pod, hashes in pods.items():
        cost = codec.key_bytes(pod)
        if budget < cost + hash_bytes:
            raise ValueError(f"a message limit of {budget} bytes cannot hold one hash of pod {pod!r}")
        i = 0
        while True:
            if room < cost + hash_bytes:
                parts.append({})
                room = budget
            take = hashes[i:i + (room - cost) // hash_bytes]
            parts[-1][pod] = take
            room -= cost + hash_bytes * len(take)
            i += len(take)
            if i >= len(hashes):
                break
    return parts


class L3Publisher:
    def __init__(self, publisher: JetStreamPublisher, subject_prefix: str, max_payload: Callable[[], int],
                 metrics: Metrics, on_refused: Callable[[str], None] | None = None, codec: Codec = MSGPACK) -> None:
        self._pub = publisher
        self._codec = codec  # the stream's encoding (nats.l3Stream.encoding)
        self._content_type = codec.content_type(CONTENT_TYPE_L3)
        self.origin = new_generation()
        self._seq: dict[str, int] = {}  # master -> the last seq published
        self._on_refused = on_refused or (lambda master: None)
        self._prefix = subject_prefix
        self._max = max_payload  # the payload limit less what the headers take (the connected server's)
        self._metrics = metrics

    def _budget(self, master: str) -> int:
        return self._max() - _ENVELOPE_BYTES - self._codec.str_bytes(master)

    def _next_seq(self, master: str) -> int:
        seq = self._seq[master] = self._seq.get(master, -1) + 1
        return seq

    def _headers(self, master: str, kind: str, msg_id: str, seq: int) -> dict[str, str]:
        return {"Nats-Msg-Id": msg_id, "Content-Type": self._content_type, "Kv-Schema": str(SCHEMA_VERSION),
                "Kv-Type": kind, "Kv-Master": master, "Kv-Origin": str(self.origin), "Kv-Seq": str(seq)}

    async def diff(self, master: str, added: dict[str, list[int]], removed: dict[str, list[int]]) -> None:
        gen = new_generation()
        budget = self._budget(master)
        parts = [("removed", p) for p in split_pods(removed, budget, self._codec) if p] + \
                [("added", p) for p in split_pods(added, budget, self._codec) if p]
        for i, (kind, pods) in enumerate(parts):
            seq = self._next_seq(master)
            payload = self._codec.encode({"v": SCHEMA_VERSION, "type": "l3_diff", "master": master,
                                     "added": pods if kind == "added" else {},
                                     "removed": pods if kind == "removed" else {}, "origin": self.origin, "seq": seq})
            headers = self._headers(master, "l3_diff", f"{master}:diff:{gen}:{i}", seq)
            if len(parts) > 1:
                headers["Kv-Part"] = f"{i + 1}/{len(parts)}"
            await self._publish(master, payload, headers, "l3_diff")

    async def gone(self, master: str, after: int) -> None:
        """The master is gone: an empty full state (its L3 entries drop), named by the stream sequence of
        the last message on its subject (sharded bridges publish it again until they see it:
        bridge/removals.py)."""
        await self.full(master, {}, msg_id=f"{master}:gone:after:{after}")

    async def full(self, master: str, pods: dict[str, list[int]], msg_id: str | None = None) -> bool:
        gen = new_generation()
        parts = split_pods(pods, self._budget(master), self._codec)
        seq = self._next_seq(master)
        for i, chunk in enumerate(parts):
            payload = self._codec.encode({"v": SCHEMA_VERSION, "type": "l3_full", "master": master, "pods": chunk,
                                     "gen": gen, "part": i, "parts": len(parts), "origin": self.origin, "seq": seq})
            headers = self._headers(master, "l3_full", f"{msg_id or f'{master}:full:{gen}'}:{i}", seq)
            headers["Kv-Part"] = f"{i + 1}/{len(parts)}"
            if i == 0:
                headers["Nats-Rollup"] = "sub"
            await self._publish(master, payload, headers, "l3_full")
        if len(parts) > 1:
            log.info("mooncake master %s: full state of %d pairs published in %d parts", master,
                     sum(map(len, pods.values())), len(parts), extra={"master": master})
        return True

    async def _publish(self, master: str, payload: bytes, headers: dict[str, str], kind: str) -> None:
        if len(payload) > self._max():  # the estimate above is an upper bound: this is a bug, not input
            raise RuntimeError(f"L3 message of {len(payload)} bytes over the limit of {self._max()}")
        self._metrics.l3_message_parts.labels(kind).inc()
        await self._pub.publish(l3_subject(self._prefix, master), payload, headers,
                                on_refused=lambda: self._on_refused(master))
