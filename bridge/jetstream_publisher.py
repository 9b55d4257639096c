"""Reliable asynchronous JetStream publishing: a bounded in-flight window with retries.

nats-py's ``publish_async`` futures never time out on their own; across a nats-server restart acks are
simply lost. Every message therefore carries a ``Nats-Msg-Id`` and stays in the window until its ack
arrives; one that is not acked within ``ack_timeout`` (or failed) is re-sent with the same id, so the
server's duplicate window turns a retry of a stored message into a no-op. ``publish`` waits while the
window is full, which pushes back on the ZMQ readers instead of growing memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from cache_indexer.metrics import Metrics
from cache_indexer.tasks import cancel_and_wait

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    subject: str
    data: bytes
    headers: dict[str, str]
    deadline: float
    future: asyncio.Future | None = None


class JetStreamPublisher:
    def __init__(self, js, metrics: Metrics, window: int = 2048, ack_timeout: float = 5.0) -> None:
        self._js = js
        self._metrics = metrics
        self._window = asyncio.Semaphore(window)
        self._ack_timeout = ack_timeout
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._idle = asyncio.Event()
        self._idle.set()
        self._watchdog: asyncio.Task | None = None

    def start(self) -> None:
        if self._watchdog is None:
            self._watchdog = asyncio.create_task(self._watch(), name="jetstream-publisher-watchdog")

    async def close(self) -> None:
        if self._watchdog:
            await cancel_and_wait(self._watchdog)
            self._watchdog = None
        for rec in self._pending.values():
            if rec.future and not rec.future.done():
                rec.future.cancel()

    async def publish(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Queue one message; returns once it is sent (not acked). ``headers`` must hold Nats-Msg-Id."""
        msg_id = headers["Nats-Msg-Id"]
        if msg_id in self._pending:
            return  # already in flight: the same message twice is one message
        await self._window.acquire()
        rec = _Pending(subject, data, headers, time.monotonic() + self._ack_timeout)
        self._pending[msg_id] = rec
        self._idle.clear()
        self._metrics.publish_inflight.set(len(self._pending))
        await self._send(msg_id, rec)

    async def _send(self, msg_id: str, rec: _Pending) -> None:
        rec.deadline = time.monotonic() + self._ack_timeout
        try:
            fut = await self._js.publish_async(rec.subject, rec.data, headers=dict(rec.headers))
        except Exception as exc:  # disconnected, closed, stalled: the watchdog retries
            log.debug("publish %s failed: %s", msg_id, exc)
            rec.future = None
            return
        rec.future = fut
        fut.add_done_callback(lambda f, mid=msg_id, r=rec: self._on_done(mid, r, f))

    def _on_done(self, msg_id: str, rec: _Pending, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None or self._pending.get(msg_id) is not rec:
            return  # the watchdog re-sends failures
        if rec.future is not fut:
            return
        del self._pending[msg_id]
        self._window.release()
        self._metrics.publish_inflight.set(len(self._pending))
        if not self._pending:
            self._idle.set()

    async def _watch(self) -> None:
        interval = max(0.05, min(0.5, self._ack_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            retry = [(mid, rec) for mid, rec in self._pending.items()
                     if rec.future is None or (rec.future.done() and (rec.future.cancelled() or rec.future.exception()))
                     or now >= rec.deadline]
            for mid, rec in retry:
                if rec.future is not None and not rec.future.done():
                    rec.future.cancel()  # frees nats-py's own pending slot
                self._metrics.publish_retries.inc()
                await self._send(mid, rec)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued message is acked; False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False
