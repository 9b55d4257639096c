"""An indexer replica: rebuilds the L1 index from the newest snapshot plus the stream's tail, then
follows the stream.

- Start: load the snapshot the KV pointer names (if any), then replay from the sequence after it with
  an ordered push consumer (infra/ordered_feed.py: no server-side state to clean up, and no timers
  but one per stream while idle).
  The replica is ready once it has applied the stream's last sequence as of start.
- Stream sequences are contiguous (no deletes, no per-subject limits), so any jump means the prefix
  this replica still needed was purged: it reloads from the snapshot. When even the snapshot does not
  reach the first retained message, history was lost to retention: counted, logged, and accepted.
- One replica at a time (a KV lease) writes snapshots every ``snapshot.everyMessages`` messages or
  ``snapshot.interval``, moves the pointer, then purges the stream up to the snapshot (never past a
  message a worker still has to read back).
- A worker's early messages past ``early_window(nats.publish.window)`` are not held in memory but read
  back from the stream, each by its stream sequence, when the worker's cursor reaches them
  (indexer/l1_state.py), before the next message is applied. A snapshot is not taken meanwhile, and the
  snapshot writer never purges past one; one gone anyway (retention, an operator's purge) is history
  lost: counted, and the worker goes on as after a lost gap.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import socket
import time
import uuid

from nats.js.errors import NotFoundError

from cache_indexer.infra.event_codec import decode, decode_packed
from cache_indexer.infra.lease import Lease
from cache_indexer.infra.loop_turns import LoopTurns
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.ordered_feed import OrderedFeed
from cache_indexer.infra.streams import (connect, ensure_again, ensure_l1_stream, ensure_l3_stream, patiently, records_bucket,
                           stream_id)
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.ticks import sleep_on_grid
from cache_indexer.indexer.l1_state import ImplausibleMessage, L1State, early_window
from cache_indexer.indexer.l3_state import L3State
from cache_indexer.indexer.run_slices import run_slices
from cache_indexer.indexer.snapshot import L1Snapshot, PartsReader, SnapshotStore
from cache_indexer.schemas.config import Config
from cache_indexer.infra.log_format import describe

log = logging.getLogger(__name__)

#: How often a replica asks for its streams' info (two JetStream API requests: the lag gauge, and
#: whether a stream was deleted or recreated) and updates the index gauges. nats-server's CPU goes by
#: the messages it wakes up for more than by their bytes, a lone one dearest (bench/RESULTS.md, the
#: trace section): what a quiet fleet asks of it every few seconds adds up.
TRACK_EVERY = 10.0

#: snapshots loaded again where a newer one was written (and the stream purged behind it) meanwhile
LOAD_AGAIN = 3
#: seconds between a consumer's idle heartbeats (two missed: the consumer is made again; a lost connection
#: or a skipped sequence remakes it at once): nats-py's own default for ordered consumers
HEARTBEAT = 5.0
_UTC = datetime.timezone.utc


def _stored_ns(ts_ns: int) -> int:
    """When JetStream stored the message (ns), what plausibility and stream time are judged by: the stored
    time of its reply subject rounded as nats-py's metadata rounded it (to the microsecond, through a
    datetime), so replicas of this version and of older ones decide alike."""
    return int(datetime.datetime.fromtimestamp(ts_ns / 1e9, _UTC).timestamp() * 1e9)


class Indexer:
    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        #: early messages of a worker held in memory (the rest is read back from the stream): at least twice
        #: the bridge's publish window, which is how many a lost publish can be overtaken by before its re-send
        self.max_early = early_window(cfg.nats.publish.window)
        self.l1 = L1State(self.max_early)
        self.l3 = L3State()
        self.l3_applied_seq = 0
        self.l3_target_seq = 0
        self.nc = None
        self.js = None
        #: the ordered consumers of the L1 and L3 streams (made once connected)
        self._feed: OrderedFeed | None = None
        self._l3_feed: OrderedFeed | None = None
        self.applied_seq = 0
        self.target_seq = 0
        self.ready = asyncio.Event()
        self.snapshots: SnapshotStore | None = None
        self.lease: Lease | None = None
        self.reloads = 0
        self.history_lost = 0
        self.snapshots_written = 0
        self._reloading = False
        self._reload_lock = asyncio.Lock()
        self._reading_back = False  # spilled messages are being read back: no snapshot now
        self._stopping = False
        self._accept_jump_to = 0
        self._last_snapshot_seq = 0
        self._last_snapshot_time = time.monotonic()
        self._tasks: list[asyncio.Task] = []
        self._stream = cfg.nats.l1Stream.name
        self._disconnected_since: float | None = None
        #: cleared while a snapshot copies the tables: L1 messages wait (in order) until it is done
        self._ingest_open = asyncio.Event()
        self._ingest_open.set()
        self._l1_stream_id = self._l3_stream_id = ""
        #: the loop's turns while stream messages are applied one after the other (L1 and L3 alike)
        self._turns = LoopTurns()
        #: set when ``snapshot.everyMessages`` were applied since the last snapshot (the snapshot loop sleeps)
        self._snapshot_wake = asyncio.Event()
        self._every_messages = cfg.snapshot.everyMessages
        self._wake_on_message = False  # the snapshot interval is over: the next message applied is due
        #: the per-message counters' children, looked up once
        self._applied_l1 = self.metrics.ingest_applied.labels(self._stream)
        self._applied_l3 = self.metrics.ingest_applied.labels(cfg.nats.l3Stream.name)

    def is_ready(self) -> bool:
        """Caught up with the streams at start-up, and connected to NATS (or not for long: a short
        reconnection is no reason to drop out of the Service; an outage is, as answers go stale)."""
        if not self.ready.is_set():
            return False
        if self._disconnected_since is None:
            return True
        return time.monotonic() - self._disconnected_since < self.cfg.nats.disconnectGrace

    async def _on_disconnected(self) -> None:
        if self._stopping:
            return  # our own close
        if self._disconnected_since is None:
            self._disconnected_since = time.monotonic()
            self.metrics.nats_disconnects.inc()
            log.warning("NATS connection lost; still ready for nats.disconnectGrace (%ss)", self.cfg.nats.disconnectGrace)

    async def _on_reconnected(self) -> None:
        if self._disconnected_since is not None:
            log.warning("NATS connection back after %.1fs", time.monotonic() - self._disconnected_since)
        self._disconnected_since = None
        for feed in (self._feed, self._l3_feed):
            if feed is not None:
                feed.reconnected()

    def _new_feed(self, stream: str, prefix: str, handler) -> OrderedFeed:
        restarts, errors = self.metrics.ingest_consumer_restarts, self.metrics.ingest_consumer_errors.labels(stream)
        return OrderedFeed(self.nc, self.js, stream, f"{prefix}.>", handler, heartbeat=HEARTBEAT,
                           on_restart=lambda reason: restarts.labels(stream, reason).inc(), on_error=errors.inc)

    async def start(self) -> None:
        self.nc = await connect(self.cfg.nats, name="cache-indexer-indexer", disconnected_cb=self._on_disconnected,
                                reconnected_cb=self._on_reconnected)
        self.js = self.nc.jetstream()
        nats = self.cfg.nats
        self._feed = self._new_feed(self._stream, nats.l1Stream.subjectPrefix, self._on_msg)
        self._l3_feed = self._new_feed(nats.l3Stream.name, nats.l3Stream.subjectPrefix, self._on_l3)
        await patiently(lambda: ensure_l1_stream(self.js, self.cfg.nats), "stream set-up")
        snap = self.cfg.snapshot
        if snap.enabled:
            self.snapshots = SnapshotStore(self.js, snap.bucket, records_bucket(self.cfg), snap.keep,
                                           replicas=self.cfg.nats.replicas)
            holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            self.lease = Lease(self.js, self.cfg.nats.lease.bucket, "snapshot-l1-writer", holder, self.cfg.nats.lease.ttl,
                               self.cfg.nats.replicas)
        await patiently(self._follow_l3, "following the L3 stream")
        await patiently(self._load_and_follow, "loading and following the L1 stream")
        self._tasks.append(asyncio.create_task(self._track_lag(), name="indexer-lag"))
        if self.lease is not None:
            self.lease.start()
            self._tasks.append(asyncio.create_task(self._snapshot_loop(), name="indexer-snapshots"))

    # -- rebuild and follow ----------------------------------------------------------------------------
    async def _load_and_follow(self) -> None:
        """(Re)build from the snapshot if it is ahead of us, then follow the stream from there."""
        await self._feed.stop()
        self._l1_stream_id = stream_id(await self.js.stream_info(self._stream))
        for again in range(LOAD_AGAIN + 1):
            if self.snapshots is not None:
                t = time.perf_counter()
                failed = self.snapshots.failed_loads
                loaded = await self.snapshots.load(self._l1_stream_id)
                self.metrics.snapshot_load_failures.inc(self.snapshots.failed_loads - failed)
                if loaded is not None and loaded[1] >= self.applied_seq:
                    self.l1, self.applied_seq = loaded
                    self.l1.max_early = self.l1.max_journal = self.max_early
                    self._last_snapshot_seq = self.applied_seq
                    self.metrics.snapshot_loads.inc()
                    log.info("loaded snapshot at stream seq %d (%d blocks) in %.2fs", self.applied_seq,
                             len(self.l1.index), time.perf_counter() - t)
            info = await self.js.stream_info(self._stream)
            first, last = info.state.first_seq, info.state.last_seq
            if first <= self.applied_seq + 1 or again == LOAD_AGAIN or not await self._newer_snapshot():
                break
            # written (and the stream purged behind it) while this one loaded: it covers the gap
            log.info("a newer snapshot was written while one loaded: loading it")
        if first > self.applied_seq + 1:  # an empty, purged stream reports first = last + 1
            self.history_lost += 1
            self.metrics.history_lost.inc()
            self._accept_jump_to = first
            log.error("stream %s starts at seq %d but the index covers only up to %d: messages were lost to "
                      "retention before a snapshot covered them; continuing from %d", self._stream, first,
                      self.applied_seq, first)
        self.target_seq = last if info.state.messages else 0
        self._reloading = False
        await self._feed.start(self.applied_seq + 1)
        self._check_ready()  # caught up already: a quiet stream sends no message that would say so

    async def _newer_snapshot(self) -> bool:
        """Whether the snapshot pointer names a state of this stream past the one applied."""
        try:
            ref = await self.snapshots.pointer()
        except Exception:
            return False
        return ref is not None and ref.stream_seq > self.applied_seq and ref.stream_id in ("", self._l1_stream_id)

    async def _follow_l3(self) -> None:
        """L3 is replayed whole: its subjects are compacted by the bridge's rollups, not by snapshots. The
        stream counts as followed only once its feed started: until then ``_track_lag`` tries again."""
        await self._l3_feed.stop()
        info = await ensure_l3_stream(self.js, self.cfg.nats)
        self.l3_target_seq = info.state.last_seq if info.state.messages else 0
        await self._l3_feed.start(1)
        self._l3_stream_id = stream_id(info)

    async def _on_l3(self, seq: int, stored_ns: int, pending: int, msg) -> None:
        if seq <= self.l3_applied_seq:
            return
        try:  # rollups leave gaps on purpose: a full state replaces what it rolled up
            incomplete, refused = self.l3.incomplete, self.l3.out_of_order
            self.l3.apply(decode(msg.data))
            if self.l3.incomplete != incomplete:
                self.metrics.l3_incomplete_states.inc(self.l3.incomplete - incomplete)
            if self.l3.out_of_order != refused:
                self.metrics.l3_out_of_order.inc(self.l3.out_of_order - refused)
        except Exception as exc:
            self.metrics.ingest_errors.labels(self.cfg.nats.l3Stream.name).inc()
            log.warning("stream %s seq %d: cannot apply message: %s", self.cfg.nats.l3Stream.name, seq, exc)
        self.l3_applied_seq = seq
        self._applied_l3.inc()
        if not self.ready.is_set():
            self._check_ready()
        await self._turns.done()

    async def _reload(self) -> None:
        self.reloads += 1
        self.metrics.stream_reloads.inc()
        self.ready.clear()
        self.metrics.ready.set(0)
        while not self._stopping:
            try:
                async with self._reload_lock:  # one at a time: the feed cannot be started twice at once
                    await self._load_and_follow()
                return
            except Exception:
                log.exception("reload failed; retrying in 1s")
                await asyncio.sleep(1.0)

    async def _on_msg(self, seq: int, stored_ns: int, pending: int, msg) -> None:
        """A message of the L1 stream (``OrderedFeed``), in stream order."""
        if not self._ingest_open.is_set():
            await self._ingest_open.wait()  # a snapshot is copying the tables
        if self._reloading or self._stopping:
            return
        if seq <= self.applied_seq:
            return  # redelivery
        if seq != self.applied_seq + 1:
            if seq == self._accept_jump_to:
                log.warning("stream %s: continuing at %d after lost history", self._stream, seq)
            else:
                log.warning("stream %s: next message is %d, expected %d (purged): reloading from the snapshot",
                            self._stream, seq, self.applied_seq + 1)
                self._reloading = True
                self._tasks.append(asyncio.create_task(self._reload(), name="indexer-reload"))
                return
        state = self.l1
        lost = state.stats.lost_gaps
        try:
            pieces, stored = run_slices(decode_packed(msg.data)), _stored_ns(stored_ns)
        except Exception as exc:
            pieces, stored = [], None
            self._refused(seq, exc)
        for i, piece in enumerate(pieces):
            if i:  # the loop answers queries between the slices of a long run
                await self._turns.give()
                if not self._ingest_open.is_set():
                    await self._ingest_open.wait()
                if self.l1 is not state or self._reloading or self._stopping:
                    return  # rebuilt meanwhile: the new state is fed from the stream
            try:  # each slice on its own, as the whole run was: the cursor moves past what is refused
                state.apply(piece, stored, seq)
            except Exception as exc:
                self._refused(seq, exc)
        if state.read_back_pending() and not await self._read_back(state):
            return  # rebuilt meanwhile, or stopping: the new state is fed from the stream
        if state.stats.lost_gaps != lost:
            self.metrics.ingest_lost_gaps.inc(state.stats.lost_gaps - lost)
        self.applied_seq = seq
        self._applied_l1.inc()
        if self._wake_on_message or seq - self._last_snapshot_seq >= self._every_messages:
            self._snapshot_wake.set()
        if not self.ready.is_set():
            self._check_ready()
        await self._turns.done()  # a backlog is applied in turns: queries are answered between them

    async def _read_back(self, state: L1State) -> bool:
        """Read back the spilled messages the workers' cursors reached, one after the other, until none is
        due. False where the state was replaced meanwhile or the replica stops (the rebuild reads the
        stream itself). A message gone from the stream (retention: the snapshot writer never purges past
        one) is history lost: counted, and the worker goes on as after a lost gap."""
        self._reading_back = True
        try:
            while (due := state.read_back_due()) is not None:
                (pod, rank), at = due
                while True:
                    try:
                        raw = await self.js.get_msg(self._stream, seq=at)
                        break
                    except NotFoundError:
                        raw = None
                        break
                    except Exception as exc:  # NATS away: the replica waits, as its consumer does
                        log.warning("stream %s: reading back seq %d failed (%s); retrying", self._stream, at,
                                    describe(exc))
                        await asyncio.sleep(0.5)
                        if self.l1 is not state or self._reloading or self._stopping:
                            return False
                if self.l1 is not state or self._reloading or self._stopping:
                    return False
                if raw is None:
                    self.history_lost += 1
                    self.metrics.history_lost.inc()
                    log.error("stream %s: seq %d of %s rank %d, held back to be read later, is gone from the stream "
                              "(retention): what it held is lost", self._stream, at, pod, rank,
                              extra={"pod": pod, "rank": rank})
                    state.read_back_gone((pod, rank), at)
                    continue
                state.read_back_taken((pod, rank), at)
                self.metrics.ingest_read_back.inc()
                self._apply_read_back(state, raw, pod, rank)
            return True
        finally:
            self._reading_back = False

    def _apply_read_back(self, state: L1State, raw, pod: str, rank: int) -> None:
        """A spilled message read back: applied as when it first came, to its worker alone."""
        try:
            pieces = run_slices(decode_packed(raw.data))
            stored = int(raw.time.timestamp() * 1e9) if raw.time is not None else None
        except Exception as exc:
            self._refused(raw.seq, exc)
            return
        for piece in pieces:
            if piece.get("pod") != pod or piece.get("rank") != rank:
                continue  # another worker's slice of it (a forged message): applied when it first came
            try:
                state.apply(piece, stored, raw.seq, read_back=True)
            except ImplausibleMessage:
                pass  # refused and counted when it first came
            except Exception as exc:
                self._refused(raw.seq, exc)

    def _refused(self, seq: int, exc: Exception) -> None:
        """A bad message (or slice of one) is counted and skipped, never fatal."""
        self.metrics.ingest_errors.labels(self._stream).inc()
        log.warning("stream %s seq %d: cannot apply message: %s", self._stream, seq, exc)

    def _check_ready(self) -> None:
        if self.applied_seq >= self.target_seq and self.l3_applied_seq >= self.l3_target_seq and not self._reloading:
            self.ready.set()
            self.metrics.ready.set(1)

    # -- snapshots ----------------------------------------------------------------------------------
    async def snapshot_now(self) -> bool:
        """Write a snapshot of the current state and compact the stream behind it."""
        if self.snapshots is None or self._reloading or not self.applied_seq:
            return False
        if self._reading_back or self.l1.read_back_pending():
            return False  # a worker is half read back: the next try comes within a second
        seq, stream = self.applied_seq, self._l1_stream_id  # the stream this state is of, named with it:
        t = time.perf_counter()  # recreated meanwhile, the new one is neither filed under it nor purged
        # what a worker of this replica, or of one close behind, still reads back stays in the stream
        floor = self.l1.purge_floor(seq + 1 - self.cfg.snapshot.purgeKeep)
        snap = L1Snapshot(self.l1, seq)  # the Python-side state, here on the loop
        self._ingest_open.clear()  # nothing is applied while the tables are copied, on a thread without
        try:                       # the GIL: queries go on meanwhile, ingest waits (its messages queue)
            exported = await asyncio.to_thread(snap.export)
        finally:
            self._ingest_open.set()
        self.metrics.snapshot_ingest_pause.observe(time.perf_counter() - t)
        blob = PartsReader(await asyncio.to_thread(snap.encode_parts, exported))
        del exported  # the pieces are the reader's alone now: it frees them in turns
        try:
            saved = await self.snapshots.save(blob, seq, stream)
        finally:
            await blob.release()
        if self._l1_stream_id != stream:
            log.warning("snapshot at stream seq %d: the stream was recreated while it was written; it is of the "
                        "old one (not loaded, nothing purged)", seq)
            return False
        self._last_snapshot_seq, self._last_snapshot_time = seq, time.monotonic()
        if not saved:
            return False
        log.info("snapshot at stream seq %d: %.1f MB in %.2fs", seq, blob.size / 1e6, time.perf_counter() - t)
        if self.cfg.snapshot.purge:
            upto = seq + 1 - self.cfg.snapshot.purgeKeep
            if floor:
                upto = min(upto, floor)
            if upto > 1:
                try:  # the snapshot stands either way; the next one purges further
                    # by name: a stream recreated before this writer noticed would lose its first messages
                    if stream_id(await self.js.stream_info(self._stream)) == stream:
                        await self.js.purge_stream(self._stream, seq=upto)
                except Exception as exc:
                    log.warning("compacting stream %s up to %d failed: %s", self._stream, upto, exc)
        # counted once the compaction behind it is done too (tests and tools wait on this)
        self.snapshots_written += 1
        self.metrics.snapshot_writes.inc()
        return True

    def _snapshot_due(self) -> bool:
        snap = self.cfg.snapshot
        return self.applied_seq - self._last_snapshot_seq >= snap.everyMessages or (
            self.applied_seq > self._last_snapshot_seq and time.monotonic() - self._last_snapshot_time >= snap.interval)

    async def _snapshot_loop(self) -> None:
        """Sleeps until a snapshot may be due: ``snapshot.interval`` after the last one, or as soon as
        ``everyMessages`` were applied (``_on_msg`` wakes it); a replica without the lease sleeps until the
        lease changes hands; a try that wrote nothing (a read-back in progress, not ready) is made again a
        second later. (A poll every second woke every replica, leader or not, for nothing.)"""
        lease, retry = self.lease, False
        while True:
            if not lease.is_leader:
                lease.changed.clear()  # (this loop is the only reader of the replica's own lease's changes)
                if not lease.is_leader:
                    await lease.changed.wait()
                continue
            if retry:
                await asyncio.sleep(1.0)
            elif not self._snapshot_due():
                left = self.cfg.snapshot.interval - (time.monotonic() - self._last_snapshot_time)
                if not self.ready.is_set():
                    timeout = 1.0
                elif left > 0:
                    timeout = left
                else:  # the interval is over and nothing came since the last snapshot: the next message is due
                    timeout, self._wake_on_message = None, True
                self._snapshot_wake.clear()
                try:
                    await asyncio.wait_for(self._snapshot_wake.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
                self._wake_on_message = False
            if not (lease.is_leader and self.ready.is_set() and self._snapshot_due()):
                retry = lease.is_leader and self._snapshot_due()  # due, not ready: in a second
                continue
            try:
                retry = not await self.snapshot_now()
            except asyncio.CancelledError:
                raise
            except Exception:
                retry = True
                log.exception("snapshot failed")

    # -- observability ------------------------------------------------------------------------------
    async def _track_lag(self) -> None:
        """A failed round is counted, logged and tried again the next one: this task must outlive NATS
        hiccups, or a recreated stream would stay unfollowed and the gauges frozen."""
        l3_stream = self.cfg.nats.l3Stream.name
        while True:
            try:
                try:
                    info = await self._stream_as_followed("l1", self._l1_stream_id)
                    if info is None:
                        self.l1, self.applied_seq, self._last_snapshot_seq = L1State(self.max_early), 0, 0
                        self._reloading = True  # from the recreated stream's start, not from an old snapshot
                        self._tasks.append(asyncio.create_task(self._reload(), name="indexer-reload"))
                    else:
                        self.metrics.ingest_lag.labels(self._stream).set(max(0, info.state.last_seq - self.applied_seq))
                    if self._l3_stream_id and await self._stream_as_followed("l3", self._l3_stream_id) is None:
                        self._l3_stream_id = ""  # followed anew below, each round until its feed starts
                    if not self._l3_stream_id:
                        self.l3, self.l3_applied_seq = L3State(), 0
                        try:
                            await self._follow_l3()
                        except Exception as exc:
                            self.metrics.ingest_consumer_errors.labels(l3_stream).inc()
                            log.error("stream %s: following it anew failed (%s); trying again in %gs", l3_stream,
                                      describe(exc), TRACK_EVERY)
                finally:
                    self.update_gauges()  # NATS away too: the ready gauge drops after disconnectGrace
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.metrics.task_errors.labels("indexer-lag").inc()
                log.warning("indexer-lag: %s; trying again in %gs", describe(exc), TRACK_EVERY)
            await sleep_on_grid(TRACK_EVERY)

    async def _stream_as_followed(self, tier: str, followed_id: str):
        """The stream's info, or None when it is not the stream this replica follows any more: deleted
        (it is created again here) or recreated meanwhile. What it held is lost: the replica rebuilds
        from the new stream (not ready meanwhile), and the bridge starts every engine and master over."""
        info, _ = await ensure_again(self.js, self.cfg.nats, tier)
        if stream_id(info) == followed_id:
            return info
        self.metrics.streams_recreated.labels(info.config.name).inc()
        log.error("stream %s is not the one this replica followed (recreated): rebuilding from it", info.config.name)
        return None

    def update_gauges(self) -> None:
        self.metrics.ready.set(1 if self.is_ready() else 0)
        for tier, idx in (("l1", self.l1.index), ("l3", self.l3.index)):
            self.metrics.index_blocks.labels(tier).set(idx.block_count())  # len() walks a native table
            self.metrics.index_entries.labels(tier).set(idx.entries())
            self.metrics.index_workers.labels(tier).set(len(idx.worker_blocks))
        self.metrics.ingest_last_seq.labels(self._stream).set(self.applied_seq)
        self.metrics.ingest_last_seq.labels(self.cfg.nats.l3Stream.name).set(self.l3_applied_seq)

    async def wait_applied(self, seq: int, timeout: float) -> None:
        """Wait until the replica has applied stream sequence ``seq`` (for tests and tools)."""
        async def _wait() -> None:
            while self.applied_seq < seq:
                await asyncio.sleep(0.005)
        await asyncio.wait_for(_wait(), timeout)

    async def stop(self) -> None:
        self._stopping = True  # no reload may start once the tasks are being cancelled
        await cancel_and_wait(*self._tasks)
        if self.lease is not None:
            await self.lease.stop()
        for feed in (self._feed, self._l3_feed):
            if feed is not None:
                await feed.stop()
        if self.nc:
            await self.nc.close()
