"""L3 stream messages: per Mooncake master, diffs and periodic full states (with Nats-Rollup: sub)."""

from __future__ import annotations

import logging

import msgpack

from bridge.jetstream_publisher import JetStreamPublisher
from bridge.l1_publisher import new_generation
from cache_indexer.metrics import Metrics
from cache_indexer.streams import l3_subject
from schemas.events import CONTENT_TYPE_L3, SCHEMA_VERSION

log = logging.getLogger(__name__)


class L3Publisher:
    def __init__(self, publisher: JetStreamPublisher, subject_prefix: str, max_payload: int, metrics: Metrics) -> None:
        self._pub = publisher
        self._prefix = subject_prefix
        self._max = max_payload
        self._metrics = metrics

    def _headers(self, master: str, kind: str, msg_id: str) -> dict[str, str]:
        return {"Nats-Msg-Id": msg_id, "Content-Type": CONTENT_TYPE_L3, "Kv-Schema": str(SCHEMA_VERSION),
                "Kv-Type": kind, "Kv-Master": master}

    async def diff(self, master: str, added: dict[str, list[int]], removed: dict[str, list[int]]) -> None:
        payload = msgpack.packb({"v": SCHEMA_VERSION, "type": "l3_diff", "master": master, "added": added,
                                 "removed": removed})
        await self._pub.publish(l3_subject(self._prefix, master), payload,
                                self._headers(master, "l3_diff", f"{master}:diff:{new_generation()}"))

    async def full(self, master: str, pods: dict[str, list[int]]) -> bool:
        payload = msgpack.packb({"v": SCHEMA_VERSION, "type": "l3_full", "master": master, "pods": pods})
        if len(payload) > self._max:
            # too large for one message: diffs alone stay correct, the subject just compacts less
            self._metrics.l3_full_state_skipped.inc()
            log.warning("mooncake master %s: full state of %d bytes exceeds the message limit; not rolled up",
                        master, len(payload))
            return False
        headers = self._headers(master, "l3_full", f"{master}:full:{new_generation()}")
        headers["Nats-Rollup"] = "sub"
        await self._pub.publish(l3_subject(self._prefix, master), payload, headers)
        return True
