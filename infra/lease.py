"""A leader lease in a JetStream KV bucket whose TTL is the lease time.

``create`` succeeds for one holder only; the holder renews with ``update(last=revision)`` every
ttl/3. When it stops renewing (crash, partition) the key expires after the TTL and another
candidate's ``create`` succeeds. Used so that exactly one indexer replica writes snapshots and one
bridge relays (active/standby).
"""

from __future__ import annotations

import asyncio
import logging

from nats.js.errors import KeyWrongLastSequenceError

from infra.streams import kv_bucket
from infra.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class Lease:
    def __init__(self, js, bucket: str, key: str, holder: str, ttl: float, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas
        self.bucket = bucket
        self.key = key
        self.holder = holder.encode()
        self.ttl = ttl
        self.is_leader = False
        self.changed = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"lease-{self.key}")

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait(self._task)
        if self.is_leader:
            try:  # hand over at once instead of after the TTL
                kv = await self.js.key_value(self.bucket)
                await kv.delete(self.key)
            except Exception:
                pass
        self.is_leader = False

    def _set(self, leader: bool) -> None:
        if leader != self.is_leader:
            self.is_leader = leader
            log.info("%s lease %s: %s", self.key, "acquired" if leader else "lost", self.holder.decode())
            self.changed.set()

    async def _loop(self) -> None:
        kv = None
        rev = 0
        while True:
            try:
                if kv is None:
                    kv = await kv_bucket(self.js, self.bucket, self.replicas, ttl=self.ttl, history=1)
                if self.is_leader:
                    rev = await kv.update(self.key, self.holder, last=rev)
                else:
                    rev = await kv.create(self.key, self.holder)
                    self._set(True)
            except KeyWrongLastSequenceError:
                self._set(False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("lease %s: %s", self.key, exc)
                self._set(False)
            await asyncio.sleep(self.ttl / 3 if self.is_leader else self.ttl / 4)
