"""Turns bridge decisions (a batch, a reset, a pod removal) into L1 stream messages.

Payloads are msgpack maps of ``schemas.events``; headers make ``nats stream view`` readable without a
decoder. ``Nats-Msg-Id`` is ``<pod>:<rank>:<gen>:<seq>``: the generation changes whenever the engine's
sequence restarts (engine restart, unrecoverable gap, bridge restart), so a restarted engine's seq 0 is
never mistaken for a duplicate, while the same batch published twice (a retry, a replay overlap) is.
"""

from __future__ import annotations

import threading
import time

import msgpack

from bridge.jetstream_publisher import JetStreamPublisher
from cache_indexer.streams import l1_lifecycle_subject, l1_subject
from schemas.events import CONTENT_TYPE_L1, SCHEMA_VERSION

_gen_lock = threading.Lock()
_last_gen = 0


def new_generation() -> int:
    """A generation number larger than any this process handed out before (wall-clock nanoseconds)."""
    global _last_gen
    with _gen_lock:
        _last_gen = max(time.time_ns(), _last_gen + 1)
        return _last_gen


def _headers(pod: str, msg_id: str, kind: str, **extra: str) -> dict[str, str]:
    h = {"Nats-Msg-Id": msg_id, "Content-Type": CONTENT_TYPE_L1, "Kv-Schema": str(SCHEMA_VERSION),
         "Kv-Type": kind, "Kv-Pod": pod}
    h.update(extra)
    return h


class L1Publisher:
    def __init__(self, publisher: JetStreamPublisher, subject_prefix: str) -> None:
        self._pub = publisher
        self._prefix = subject_prefix

    async def batch(self, pod: str, rank: int, gen: int, seq: int, ts: float | None, events: list[dict]) -> None:
        payload = msgpack.packb({"v": SCHEMA_VERSION, "type": "batch", "pod": pod, "rank": rank, "gen": gen,
                                 "seq": seq, "ts": ts, "events": events})
        kinds = ",".join(sorted({e["kind"] for e in events}))
        headers = _headers(pod, f"{pod}:{rank}:{gen}:{seq}", "batch", **{
            "Kv-Dp-Rank": str(rank), "Kv-Gen": str(gen), "Kv-Seq": str(seq),
            "Kv-Events": str(len(events)), "Kv-Kinds": kinds or "-"})
        await self._pub.publish(l1_subject(self._prefix, pod, rank), payload, headers)

    async def reset(self, pod: str, rank: int, gen: int, next_seq: int, reason: str) -> None:
        payload = msgpack.packb({"v": SCHEMA_VERSION, "type": "reset", "pod": pod, "rank": rank, "gen": gen,
                                 "next_seq": next_seq, "reason": reason})
        headers = _headers(pod, f"{pod}:{rank}:{gen}:reset", "reset", **{
            "Kv-Dp-Rank": str(rank), "Kv-Gen": str(gen), "Kv-Seq": str(next_seq), "Kv-Reason": reason})
        await self._pub.publish(l1_subject(self._prefix, pod, rank), payload, headers)

    async def pod_removed(self, pod: str, reason: str) -> None:
        payload = msgpack.packb({"v": SCHEMA_VERSION, "type": "pod_removed", "pod": pod, "reason": reason})
        headers = _headers(pod, f"{pod}:removed:{new_generation()}", "pod_removed", **{"Kv-Reason": reason})
        await self._pub.publish(l1_lifecycle_subject(self._prefix, pod), payload, headers)
