"""L3 stream messages: per Mooncake master, diffs and periodic full states (with Nats-Rollup: sub)."""

from __future__ import annotations

import msgpack

from bridge.jetstream_publisher import JetStreamPublisher
from bridge.l1_publisher import new_generation
from cache_indexer.streams import l3_subject
from schemas.events import CONTENT_TYPE_L3, SCHEMA_VERSION


class L3Publisher:
    def __init__(self, publisher: JetStreamPublisher, subject_prefix: str, max_payload: int) -> None:
        self._pub = publisher
        self._prefix = subject_prefix
        self._max = max_payload
        self.skipped_full = 0

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
            self.skipped_full += 1  # too large for one message: diffs alone stay correct, only less compact
            return False
        headers = self._headers(master, "l3_full", f"{master}:full:{new_generation()}")
        headers["Nats-Rollup"] = "sub"
        await self._pub.publish(l3_subject(self._prefix, master), payload, headers)
        return True
