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

A master's messages go out one at a time, each with ``Nats-Expected-Last-Subject-Sequence``: the stream
sequence of the last message on the master's subject as this publisher knows it (its own last one
stored, or read from the stream). The stream stores a message only onto what its publisher saw, so the
subject is one chain: a full state re-sent late (its first send lost with a server) is refused instead
of rolling up the parts and diffs stored after it, and so is whatever an old owner of the master still
sends after a failover or a shard's handover (its full state applied over the new owner's, its diffs
after the new owner's full state). A refusal makes this publisher read the subject again and, through
``on_refused``, its poller publish the full state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.js.errors import NotFoundError

from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
from cache_indexer.bridge.l1_publisher import new_generation
from cache_indexer.infra.event_codec import MSGPACK, Codec
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.streams import l3_subject
from cache_indexer.schemas.events import CONTENT_TYPE_L3, SCHEMA_VERSION

log = logging.getLogger(__name__)

#: How long a master's message waits for its ack before the next one goes out anyway, with the subject read
#: again (the message stays with the JetStream publisher, which re-sends it; stored late onto a subject that
#: moved on, it is refused)
ACK_WAIT = 15.0
#: The header that makes the stream store a message only onto the subject's last message as its sender saw it
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"


class NotAcknowledged(Exception):
    """A master's message not acknowledged within ``ack_wait`` (NATS away): the poll fails, the next one
    publishes the full state onto the subject read again."""


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
                 metrics: Metrics, on_refused: Callable[[str], None] | None = None, codec: Codec = MSGPACK,
                 js=None, stream: str = "", ack_wait: float | None = None) -> None:
        self._pub = publisher
        #: where the subject's last message is read (None: no chain: tools and tests that write alone)
        self._js = js
        self._stream = stream
        self._ack_wait = ACK_WAIT if ack_wait is None else ack_wait
        #: master -> the stream sequence of the last message on its subject as this publisher knows it
        self._last: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}  # one publish of a master at a time
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

    def _lock(self, master: str) -> asyncio.Lock:
        lock = self._locks.get(master)
        if lock is None:
            lock = self._locks[master] = asyncio.Lock()
        return lock

    async def diff(self, master: str, added: dict[str, list[int]], removed: dict[str, list[int]]) -> None:
        async with self._lock(master):
            await self._diff(master, added, removed)

    async def _diff(self, master: str, added: dict[str, list[int]], removed: dict[str, list[int]]) -> None:
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
            if not await self._publish(master, payload, headers, "l3_diff"):
                return

    async def gone(self, master: str, after: int) -> None:
        """The master is gone: an empty full state (its L3 entries drop), named by the stream sequence of
        the last message on its subject (sharded bridges publish it again until they see it:
        bridge/removals.py), and stored onto whatever the subject holds last when it is sent."""
        async with self._lock(master):
            self._last.pop(master, None)  # onto whatever is last now (the subject may be empty: purged, aged out)
            await self._full(master, {}, msg_id=f"{master}:gone:after:{after}")

    def forget(self, master: str) -> None:
        """Where ``master``'s subject stands is read again at its next publish (this bridge no longer polls
        it, or the stream was created again)."""
        self._last.pop(master, None)

    async def full(self, master: str, pods: dict[str, list[int]], msg_id: str | None = None) -> bool:
        """False where the stream refused a part (the rest is not sent)."""
        async with self._lock(master):
            return await self._full(master, pods, msg_id)

    async def _full(self, master: str, pods: dict[str, list[int]], msg_id: str | None = None) -> bool:
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
            if not await self._publish(master, payload, headers, "l3_full"):
                return False
        if len(parts) > 1:
            log.info("mooncake master %s: full state of %d pairs published in %d parts", master,
                     sum(map(len, pods.values())), len(parts), extra={"master": master})
        return True

    async def _publish(self, master: str, payload: bytes, headers: dict[str, str], kind: str) -> bool:
        """One message of the master, onto the last one on its subject; True once stored (or, without a
        chain, once sent). False where the stream refused it: the subject is read again for the next one."""
        if len(payload) > self._max():  # the estimate above is an upper bound: this is a bug, not input
            raise RuntimeError(f"L3 message of {len(payload)} bytes over the limit of {self._max()}")
        self._metrics.l3_message_parts.labels(kind).inc()
        subject = l3_subject(self._prefix, master)
        if self._js is None:
            await self._pub.publish(subject, payload, headers, on_refused=lambda: self._on_refused(master))
            return True
        last = self._last.get(master)
        if last is None:
            last = self._last[master] = await self._last_on_subject(subject)
        headers[EXPECTED_LAST] = str(last)
        answer: asyncio.Future = asyncio.get_running_loop().create_future()

        def stored(stream_seq: int) -> None:
            if not answer.done():
                answer.set_result(stream_seq)

        def refused() -> None:
            if not answer.done():
                answer.set_result(None)
        await self._pub.publish(subject, payload, headers, stored, refused)
        try:
            seq = await asyncio.wait_for(asyncio.shield(answer), self._ack_wait)
        except asyncio.TimeoutError:
            self._last.pop(master, None)  # where the subject stands is not known: read again
            raise NotAcknowledged(f"L3 message of master {master} not acknowledged within {self._ack_wait:.0f}s") from None
        except BaseException:
            self._last.pop(master, None)
            raise
        if seq is None:
            self._last.pop(master, None)
            seq = await self._stored_after_all(subject, headers["Nats-Msg-Id"])
            if seq is None:
                log.warning("mooncake master %s: the stream moved on since this bridge's last message (another "
                            "bridge took the master over?): its full state is published anew", master,
                            extra={"master": master})
                self._on_refused(master)
                return False
        self._last[master] = seq
        return True

    async def _stored_after_all(self, subject: str, msg_id: str) -> int | None:
        """Where a refused message is the subject's last one after all, its stream sequence: stored, its ack
        lost, and refused when re-sent (the stream checks the expected sequence before the duplicate)."""
        try:
            last = await self._js.get_last_msg(self._stream, subject)
        except Exception:  # none, or NATS away: taken as refused (the full state comes anew)
            return None
        return last.seq if (last.headers or {}).get("Nats-Msg-Id") == msg_id else None

    async def _last_on_subject(self, subject: str) -> int:
        """The stream sequence of the subject's last message (0: none)."""
        try:
            return (await self._js.get_last_msg(self._stream, subject)).seq
        except NotFoundError:
            return 0
