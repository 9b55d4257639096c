"""An indexer replica: follows the L1 stream from its start and keeps the in-memory index current.

It uses an ordered push consumer with a callback (the fast replay path in nats-py, and no server-side
state to clean up). At start it records the stream's last sequence; the replica reports ready once it
has applied up to there, so a restarted replica does not answer from a half-built index.
"""

from __future__ import annotations

import asyncio
import logging

import msgpack
from nats.js import api

from cache_indexer.metrics import Metrics
from cache_indexer.streams import connect, ensure_l1_stream
from indexer.l1_state import L1State
from schemas.config import Config

log = logging.getLogger(__name__)


class Indexer:
    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.l1 = L1State()
        self.nc = None
        self.js = None
        self._sub = None
        self.applied_seq = 0
        self.target_seq = 0
        self.ready = asyncio.Event()
        self._lag_task: asyncio.Task | None = None
        self._stream = cfg.nats.l1Stream.name

    async def start(self) -> None:
        self.nc = await connect(self.cfg.nats, name="cache-indexer-indexer")
        self.js = self.nc.jetstream()
        info = await ensure_l1_stream(self.js, self.cfg.nats)
        self.target_seq = info.state.last_seq if info.state.messages else 0
        self._check_ready()
        self._sub = await self.js.subscribe(
            f"{self.cfg.nats.l1Stream.subjectPrefix}.>", stream=self._stream, ordered_consumer=True, cb=self._on_msg,
            idle_heartbeat=2.0, pending_msgs_limit=-1, pending_bytes_limit=-1,
            config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL),
        )
        self._lag_task = asyncio.create_task(self._track_lag(), name="indexer-lag")

    async def _on_msg(self, msg) -> None:
        seq = msg.metadata.sequence.stream
        if seq <= self.applied_seq:
            return  # redelivery
        try:
            self.l1.apply(msgpack.unpackb(msg.data, raw=False))
        except Exception as exc:  # a bad message is counted and skipped, never fatal
            self.metrics.ingest_errors.labels(self._stream).inc()
            log.warning("stream %s seq %d: cannot apply message: %s", self._stream, seq, exc)
        self.applied_seq = seq
        self.metrics.ingest_applied.labels(self._stream).inc()
        if not self.ready.is_set():
            self._check_ready()

    def _check_ready(self) -> None:
        if self.applied_seq >= self.target_seq:
            self.ready.set()
            self.metrics.ready.set(1)

    async def _track_lag(self) -> None:
        while True:
            try:
                info = await self.js.stream_info(self._stream)
                self.metrics.ingest_lag.labels(self._stream).set(max(0, info.state.last_seq - self.applied_seq))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("stream info: %s", exc)
            self.update_gauges()
            await asyncio.sleep(2.0)

    def update_gauges(self) -> None:
        idx = self.l1.index
        self.metrics.index_blocks.labels("l1").set(len(idx))
        self.metrics.index_entries.labels("l1").set(idx.entries())
        self.metrics.index_workers.labels("l1").set(len(idx.worker_blocks))
        self.metrics.ingest_last_seq.labels(self._stream).set(self.applied_seq)

    async def wait_applied(self, seq: int, timeout: float) -> None:
        """Wait until the replica has applied stream sequence ``seq`` (for tests and tools)."""
        async def _wait() -> None:
            while self.applied_seq < seq:
                await asyncio.sleep(0.005)
        await asyncio.wait_for(_wait(), timeout)

    async def stop(self) -> None:
        if self._lag_task:
            self._lag_task.cancel()
            await asyncio.gather(self._lag_task, return_exceptions=True)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
        if self.nc:
            await self.nc.close()
