"""A leader lease in a JetStream KV bucket whose TTL is the lease time.

``create`` succeeds for one holder only; the holder renews with ``update(last=revision)`` every
ttl/3. When it stops renewing (crash, partition) the key expires after the TTL and another
candidate's ``create`` succeeds. Used so that exactly one indexer replica writes snapshots and one
bridge relays (active/standby).

A renewal that fails for a passing reason (a timeout, no responders: a nats-server restarting) does not
give the lease up while it is surely still ours: the key the server stored can expire no earlier than
the TTL after the last renewal that succeeded was sent, so the holder keeps it until 80 % of that has
passed, retrying meanwhile (each try bounded to a fifth of the TTL, so a request lost with a dying
server is not waited on for the whole request timeout). Dropping it at the first failure made the
active bridge stop and resubscribe every engine at each nats-server restart (issue 36): a busy
engine's batches published but not acked yet were then beyond its replay buffer, and it started a new
generation. A renewal refused because the revision moved (or a create refused) is checked: a write
stored although its reply was lost left the key ours.
"""

from __future__ import annotations

import asyncio
import logging
import time

from nats.js.errors import KeyWrongLastSequenceError

from cache_indexer.infra.streams import kv_bucket
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.ticks import sleep_on_grid
from cache_indexer.infra.log_format import describe

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

    def _set(self, leader: bool, why: str = "") -> None:
        """Losing the lease is a WARNING: the holder stops working (a bridge stops relaying) until it wins
        the lease again; acquiring it is routine."""
        if leader != self.is_leader:
            self.is_leader = leader
            fields = {"lease": self.key, "holder": self.holder.decode()}
            if leader:
                log.info("%s lease acquired by %s", self.key, fields["holder"], extra=fields)
            else:
                log.warning("%s lease lost by %s: %s", self.key, fields["holder"], why, extra=fields)
            self.changed.set()

    async def _loop(self) -> None:
        kv = None
        rev = 0
        held_until = 0.0  # monotonic: the lease is surely ours until then (80 % of a TTL after a renewal was sent)
        attempt = max(0.25, self.ttl / 5)
        while True:
            retry_soon = False
            sent = time.monotonic()
            try:
                if kv is None:
                    kv = await kv_bucket(self.js, self.bucket, self.replicas, ttl=self.ttl, history=1)
                if self.is_leader:
                    rev = await asyncio.wait_for(kv.update(self.key, self.holder, last=rev), attempt)
                else:
                    rev = await asyncio.wait_for(kv.create(self.key, self.holder), attempt)
                    self._set(True)
                held_until = sent + self.ttl * 0.8
            except KeyWrongLastSequenceError:
                ours = await self._still_ours(kv)
                if ours is None:
                    self._set(False, "another holder's write replaced ours")
                else:  # an earlier write was stored though its reply was lost: the key is ours, renewed now
                    rev, retry_soon = ours, True
                    self._set(True)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.is_leader and time.monotonic() < held_until:
                    log.warning("lease %s not renewed (%s); still held for %.1fs, retrying", self.key,
                                describe(exc), held_until - time.monotonic())
                    retry_soon = True
                else:
                    log.debug("lease %s: %s", self.key, exc)
                    self._set(False, f"not renewed within 80% of the TTL ({describe(exc)})")
            if retry_soon:
                await asyncio.sleep(min(0.5, self.ttl / 10))
            else:
                await sleep_on_grid(self.ttl / 3 if self.is_leader else self.ttl / 4)

    async def _still_ours(self, kv) -> int | None:
        """The key's revision where it still names this holder (None: another holder's, gone, unreadable)."""
        try:
            entry = await kv.get(self.key)
        except asyncio.CancelledError:
            raise
        except Exception:
            return None
        return entry.revision if entry is not None and entry.value == self.holder else None
