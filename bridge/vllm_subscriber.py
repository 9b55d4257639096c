"""One vLLM KV-event publisher endpoint (a pod's data-parallel rank): the ZMQ sockets and their I/O.

vLLM sends ``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` with seq counting from 0 per
engine process. What each batch becomes on the stream (generations, gaps, resets) is decided by
bridge/l1_sequencer.py; this module
- reads the SUB socket ahead into a queue bounded in bytes (bridge/receive_budget.py): a batch that does
  not fit is dropped and replayed once the queue is empty again, and replays too come in chunks that fit;
- gives the sequencer the engine's replay socket (bridge/vllm_replay.py);
- watches the connection: libzmq reconnects by itself with exponential backoff (``backoffInitial`` ..
  ``backoffMax``); a connection it gives up on (a message over ``maxBatchBytes``) is opened anew, and
  once connected the engine's buffer is asked at once for what it published meanwhile (the oversized
  batch at least): an engine that went idle would otherwise never send the live batch whose gap brings
  them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from cache_indexer.bridge.block_key_check import BlockKeyCheck
from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.l1_publisher import L1Publisher
from cache_indexer.bridge.l1_sequencer import L1Sequencer, Replayed
from cache_indexer.bridge.read_sweep import read_sweep
from cache_indexer.bridge.receive_budget import BATCH_OVERHEAD, ReceiveBudget
from cache_indexer.bridge.vllm_replay import VllmReplayClient
from cache_indexer.bridge.zmq_drain import drainer
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.config import L1IngestConfig
from cache_indexer.schemas.events import MAX_SEQ

__all__ = ["Endpoint", "Replayed", "VllmSubscriber"]  # Endpoint and Replayed: where they were before

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)
PUBLISH_BURST = 256  # queued batches handled without yielding to the event loop
#: Messages read from libzmq without yielding: reading ahead must outpace publishing, or the backlog
#: waits in the engine's send queue (vLLM's PUB holds up to 100,000 messages in the engine's memory).
READ_BURST = 4096
#: Longest wait for libzmq's signal: a missed one costs at most this much delay (bridge/read_sweep.py).
#: Each sweep asks every subscription's socket: with 1,000 engines connected and quiet, a bridge used
#: 0.7% of a core at 1 s, 0.2% at 5 s (issue 37).
READ_WAIT_MAX = 5.0
#: A new subscription asks the engine's buffer at once when no live batch comes within this after it
#: connected (an idle engine, otherwise invisible until it publishes again).
FIRST_CONTACT_QUIET = 0.2
class VllmSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: Endpoint, cfg: L1IngestConfig, sink: L1Publisher,
                 metrics: Metrics, replay_slots: asyncio.Semaphore, block_key_check: BlockKeyCheck | None = None,
                 budget: ReceiveBudget | None = None) -> None:
        self.ctx = ctx
        self.ep = endpoint
        self.log = logging.LoggerAdapter(log, {"pod": endpoint.pod, "rank": endpoint.rank})
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self.block_key_check = block_key_check
        self.budget = budget or ReceiveBudget(cfg.maxBufferedBytes)
        #: batches read ahead of publishing, with their budget bytes
        self._queue: deque[tuple[list[bytes], int]] = deque()
        self._queued = asyncio.Event()
        #: the highest seq dropped for want of room and not yet replayed
        self._dropped_upto: int | None = None
        self._overflow_log = ThrottledWarning(log, every=10.0)
        self._reader: asyncio.Task | None = None
        self._malformed_log = ThrottledWarning(log, every=10.0)
        #: what to publish for each batch
        #: the engine's buffer, asked by the sequencer
        self.replay = VllmReplayClient(ctx, endpoint, cfg, self.budget, metrics, replay_slots)
        self.sequencer = L1Sequencer(endpoint, sink, metrics, self.replay, cfg.coalesceMaxBatches,
                                     cfg.coalesceMaxBytes, block_key_check)
        self._task: asyncio.Task | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task | None = None
        #: since when the SUB socket has had no connection to the engine (None: connected)
        self.disconnected_since: float | None = None
        #: the socket was made anew and is connected: what the engine published meanwhile is to be asked
        self._catch_up_due = False
        #: the stream lost what was published: the loop starts a new generation between its operations
        self._start_over_due = False

    # -- lifecycle ---------------------------------------------------------------------------------
    async def resume_from_stream(self) -> None:
        """Continue where the stream stands for this (pod, rank) (bridge/resume_points.py)."""
        self.sequencer.resume(await self.sink.last_position(self.ep.pod, self.ep.rank))

    def start_over(self) -> None:
        """The stream lost what was published: a new generation from what the engine's buffer holds, as
        soon as the engine is there (an idle engine's blocks would otherwise be missing until its next
        batch). The loop applies it between its operations: a replay or a publish under way ends with the
        generation it began with."""
        self._start_over_due = True
        self._queued.set()

    def start(self) -> None:
        """Raises what the socket's making raised (an endpoint libzmq refuses, no file descriptors
        left), with nothing started or counted."""
        self._open()
        self.sink.watch_refusals(self.ep.pod, self.ep.rank, self._on_refused)
        self.disconnected_since = time.monotonic()
        self.metrics.subscriptions_disconnected.inc()  # until its first connection
        self._task = asyncio.create_task(self._loop(), name=f"vllm-sub-{self.ep.pod}-{self.ep.rank}")
        self._monitor_task = asyncio.create_task(self._watch_connection(), name=f"vllm-mon-{self.ep.pod}-{self.ep.rank}")
        self.metrics.subscriptions.inc()

    def _open(self) -> None:
        """The SUB socket (with its monitor) and the task reading it ahead into the queue."""
        sock = self.ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, self.cfg.rcvHwm)
            sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.maxBatchBytes)  # libzmq disconnects a peer that sends more
            sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.cfg.backoffInitial * 1000)))
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.cfg.backoffMax * 1000)))
            sock.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
            self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                    | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECT_DELAYED)
            sock.connect(self.ep.pub)
        except BaseException:  # nothing half made is left open
            if self._monitor is not None:
                sock.disable_monitor()
                self._monitor.close(0)
                self._monitor = None
            sock.close(0)
            raise
        self._sock = sock
        self._reader = asyncio.create_task(self._read(), name=f"vllm-read-{self.ep.pod}-{self.ep.rank}")

    async def _close_socket(self) -> None:
        """Closed also when the caller is cancelled while the reader ends (a bridge's stop cancels a pod's
        removal until it is done): a socket left open holds the bridge's ``ctx.term()`` for ever."""
        try:
            await cancel_and_wait(self._reader)  # first: it reads the socket
        finally:
            if self._sock is not None:
                self._sock.disable_monitor()
                self._sock.close(0)
                self._sock = None
            if self._monitor is not None:
                self._monitor.close(0)
                self._monitor = None

    async def _reopen(self) -> None:
        """The socket made anew; a failure (no file descriptors left, say) is logged, counted and tried
        again after the reconnect backoff: without a socket the engine is never heard again."""
        delay = self.cfg.backoffInitial
        while True:
            try:
                self._open()
                return
            except Exception as exc:
                self.metrics.task_errors.labels("vllm-subscription").inc()
                self.log.error("%s rank %d: making the socket to %s anew failed (%s); trying again in %.1fs",
                               self.ep.pod, self.ep.rank, self.ep.pub, exc, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, max(self.cfg.backoffMax, self.cfg.backoffInitial))

    async def _watch_connection(self) -> None:
        """Follows the SUB socket's connection. libzmq reconnects by itself after a connection drops, and
        says so (a retry, a delayed connect) within its reconnect interval; after a protocol error, a
        message over ``maxBatchBytes`` among them, it gives the connection up without a word, and the
        engine's batches would never arrive again. Such a socket is made anew (counted in
        ``cache_indexer_bridge_resubscribes_total``); the batches missed meanwhile are a gap like any."""
        connects = 0
        given_up_after = max(1.0, 3 * self.cfg.backoffInitial)
        dropped_at: float | None = None  # a disconnection libzmq has shown no sign of repairing yet
        resubscribed = False  # a socket made anew, not connected yet
        while True:
            wait = None if dropped_at is None else max(0.0, dropped_at + given_up_after - time.monotonic())
            try:
                event = parse_monitor_message(await asyncio.wait_for(self._monitor.recv_multipart(), wait))
            except asyncio.TimeoutError:
                self.metrics.bridge_resubscribes.inc()
                self.log.warning("%s rank %d: the connection to %s dropped and libzmq does not reconnect (a message over "
                                 "ingest.l1.maxBatchBytes=%d, or another protocol error): subscribing again", self.ep.pod,
                                 self.ep.rank, self.ep.pub, self.cfg.maxBatchBytes)
                await self._close_socket()
                await self._reopen()
                dropped_at = None
                resubscribed = True
                continue
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # the subscription is closing
            except Exception:
                self.log.exception("%s rank %d: unreadable socket monitor event", self.ep.pod, self.ep.rank)
                continue
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                dropped_at = None
                connects += 1
                if self.disconnected_since is not None:
                    self.disconnected_since = None
                    self.metrics.subscriptions_disconnected.dec()
                    self._queued.set()  # a first contact waits for it
                if connects > 1:
                    self.sequencer.reconnected = True
                    self.log.info("%s rank %d: reconnected to %s", self.ep.pod, self.ep.rank, self.ep.pub)
                if resubscribed:  # at least the batch the old connection broke on is missing: ask for it now
                    resubscribed = False
                    self._catch_up_due = True
                    self._queued.set()
            elif kind == zmq.EVENT_DISCONNECTED:
                dropped_at = time.monotonic()
                if self.disconnected_since is None:
                    self.disconnected_since = dropped_at
                    self.metrics.subscriptions_disconnected.inc()
            else:  # a retry or a delayed connect: libzmq is at it
                dropped_at = None

    async def stop(self) -> None:
        """Also when the caller is cancelled meanwhile (a bridge stopping while a pod is being removed):
        the socket is closed in any case, or the bridge's ``ctx.term()`` would wait for it for ever."""
        try:
            self.sink.watch_refusals(self.ep.pod, self.ep.rank, None)
            if self._task:
                task, self._task = self._task, None
                self.metrics.subscriptions.dec()
                if self.disconnected_since is not None:
                    self.disconnected_since = None
                    self.metrics.subscriptions_disconnected.dec()
                await cancel_and_wait(self._monitor_task)  # first: it may open a new socket
                await cancel_and_wait(task, self._reader)
        finally:
            while self._queue:
                self.budget.give(self._queue.popleft()[1])
            await self._close_socket()

    async def _read(self) -> None:
        """Take what arrives into the queue while there is room in the budget, else drop it (counted)
        and remember to replay it.

        Plain non-blocking receives on a (non-asyncio) shadow of the socket (in bulk through
        bridge/zmq_drain.py where it is built), woken by libzmq's own FD:
        an awaited receive of zmq.asyncio costs a future and poller bookkeeping per message, and mixing
        both lost wake-ups once the socket's queue had been full (rcvHwm; measured 40k instead of 129k
        block events/s). The FD is edge-triggered: it signals a change, so after reading, ZMQ_EVENTS
        says whether more is there; the wait is only entered when it says no."""
        sock = self._sock
        assert sock is not None
        plain = zmq.Socket.shadow(sock.underlying)  # the same socket, without asyncio
        drain = drainer(plain)  # None: through pyzmq
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()
        fd = plain.get(zmq.FD)
        loop.add_reader(fd, signalled.set)
        sweep = read_sweep(READ_WAIT_MAX)
        sweep.watch(plain, signalled, self.metrics.bridge_read_sweep_woken.inc)
        try:
            while True:
                try:
                    signalled.clear()
                    if sock.closed:  # the bulk receive must never see a closed socket's address
                        return
                    if drain is not None:
                        messages, error = drain(READ_BURST)
                        for frames in messages:
                            self._take(frames)
                        if error is not None:
                            raise error
                    else:
                        self._receive_burst(plain)
                    if self._queue or self._dropped_upto is not None:  # a drop too: its replay is due
                        self._queued.set()  # (all of a burst may drop while other engines fill the budget)
                    if plain.get(zmq.EVENTS) & zmq.POLLIN:
                        await asyncio.sleep(0)  # more is there: let the others run first
                        continue
                except asyncio.CancelledError:
                    raise
                except (zmq.ZMQError, OSError):  # OSError: from the bulk receive
                    if plain.closed or sock.closed:
                        return
                    self.log.exception("%s rank %d: receive failed", self.ep.pod, self.ep.rank)
                except Exception:
                    self.log.exception("%s rank %d: receive failed", self.ep.pod, self.ep.rank)
                await signalled.wait()  # bounded: a missed signal is found by the sweep
        finally:
            sweep.forget(signalled)
            loop.remove_reader(fd)

    def _receive_burst(self, plain: zmq.Socket) -> None:
        """Without the bulk receive: through pyzmq, as Frames (RCVMORE through getsockopt costs an enum
        lookup per frame, a third of a receive)."""
        recv = plain.recv
        for _ in range(READ_BURST):
            try:
                frame = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [frame.bytes]
            while frame.more:
                frame = recv(_NOBLOCK, copy=False)
                frames.append(frame.bytes)
            self._take(frames)

    def _take(self, frames: list[bytes]) -> None:
        size = BATCH_OVERHEAD
        for f in frames:
            size += len(f)
        if self.budget.take_live(size):
            self._queue.append((frames, size))
            return
        self.metrics.bridge_batches.labels("overflow").inc()
        if len(frames) == 3 and len(frames[1]) == 8:
            seq = int.from_bytes(frames[1], "big")
            if seq <= MAX_SEQ and (self._dropped_upto is None or seq > self._dropped_upto):
                self._dropped_upto = seq
        self._overflow_log("%s rank %d: receive budget full (%d of ingest.l1.maxBufferedBytes=%d bytes taken); "
                           "batches dropped, to be replayed", self.ep.pod, self.ep.rank, self.budget.taken,
                           self.budget.limit)

    def _on_refused(self, gen: int, first: int, last: int) -> None:
        if self.sequencer.refused(gen, first, last):
            self._queued.set()  # handled by the loop, between two bursts

    async def _contact(self, what: str) -> None:
        """The catch-up of a subscription's start, or of a new generation after the stream lost what was
        published. Where no generation is known (a first contact), the engine's buffer is asked once the
        engine is there (connected, or a batch came), not before (an engine still starting would time the
        replay out into its cooldown), and only while it is quiet: a busy engine's live batches start its
        generation, as they always did."""
        if self.sequencer.gen is None and self.ep.replay:
            while self.disconnected_since is not None and not self._queue:
                self._queued.clear()
                await self._queued.wait()
            if not self._queue:
                self._queued.clear()
                try:
                    await asyncio.wait_for(self._queued.wait(), FIRST_CONTACT_QUIET)
                except asyncio.TimeoutError:
                    pass
        await self._guarded(self.sequencer.catch_up(first_contact=not self._queue), what)

    async def _loop(self) -> None:
        await self._contact("catching up on first contact")
        while True:
            if self._start_over_due:
                self._start_over_due = self._catch_up_due = False
                self.sequencer.start_over()
                await self._contact("starting over on a new stream")
                continue
            if self._catch_up_due:  # subscribed anew: what the engine's buffer holds after the last published
                self._catch_up_due = False
                await self._guarded(self.sequencer.catch_up(first_contact=not self._queue),
                                    "catching up after subscribing again")
                continue
            if self.sequencer.refused_upto is not None:
                await self._guarded(self.sequencer.after_refusal(), "starting over after a refused publish")
                continue
            if not self._queue:
                if self._dropped_upto is not None:  # the tail of a burst was dropped: replay it now
                    upto, self._dropped_upto = self._dropped_upto, None
                    sequencer = self.sequencer
                    if sequencer.gen is not None and sequencer.last is not None and upto > sequencer.last:
                        gen = sequencer.gen
                        if not await self._guarded(sequencer.replay_tail(upto), "replaying from the engine's buffer"):
                            await self._tail_again(upto, gen)
                    continue
                if self.sequencer.pending.batches:
                    await self._guarded(self.sequencer.flush(), "publishing batches")
                    continue  # the reader may have queued (and signalled) meanwhile: look again first
                self._queued.clear()
                await self._queued.wait()
                continue
            for _ in range(PUBLISH_BURST):
                if not self._queue:
                    break
                frames, size = self._queue.popleft()
                try:
                    if not self._take_usual(frames):
                        await self._on_frames(frames)
                    elif self.sequencer.pending.full():
                        await self._guarded(self.sequencer.flush(), "publishing batches")
                finally:
                    self.budget.give(size)
            await self._guarded(self.sequencer.flush(), "publishing batches")
            if self._queue:  # more to work off: the others' turn first (else the wait above yields anyway,
                await asyncio.sleep(0)  # without a round of the loop a batch for nothing: each comes alone at 5x)

    async def _guarded(self, work, what: str):
        """Run ``work`` of the subscription's loop; a failure is logged, never the end of the loop (None)."""
        try:
            return await work
        except asyncio.CancelledError:
            raise
        except Exception:
            self.metrics.task_errors.labels("vllm-subscription").inc()
            self.log.exception("%s rank %d: %s failed", self.ep.pod, self.ep.rank, what)
            return None

    async def _tail_again(self, upto: int, gen: int) -> None:
        """The dropped tail up to ``upto`` did not come from the engine's buffer: asked again after the
        replay cooldown (live batches arriving meanwhile go first; their gap handling may settle it)."""
        if self.sequencer.gen != gen:
            return  # a new generation meanwhile: it starts from the engine's buffer itself
        self._dropped_upto = max(upto, self._dropped_upto or 0)
        self.metrics.bridge_replays.labels("tail_retry").inc()
        self._queued.clear()
        try:
            await asyncio.wait_for(self._queued.wait(), max(self.cfg.replayCooldown, self.cfg.backoffInitial))
        except asyncio.TimeoutError:
            pass

    def _take_usual(self, frames: list[bytes]) -> bool:
        """The sequencer's path without a coroutine for the usual batch (``take_usual``); False:
        ``_on_frames`` decides."""
        try:
            return len(frames) == 3 and len(frames[1]) == 8 and self.sequencer.take_usual(
                int.from_bytes(frames[1], "big"), frames[2])
        except Exception:  # never let one message kill the subscription (dropped, as _on_frames drops it)
            self.log.exception("%s rank %d: failed to handle a batch", self.ep.pod, self.ep.rank)
            return True

    async def _on_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                self.metrics.bridge_malformed.inc()
                self._malformed_log("%s rank %d: unexpected frame layout (%d frames)", self.ep.pod,
                                    self.ep.rank, len(frames))
                return
            await self.sequencer.on_message(int.from_bytes(frames[1], "big"), frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one message kill the subscription
            self.log.exception("%s rank %d: failed to handle a batch", self.ep.pod, self.ep.rank)

