"""One vLLM KV-event publisher endpoint (a pod's data-parallel rank): ZMQ SUB, sequence tracking, replay.

vLLM sends ``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` with seq counting from 0 per
engine process. Per (pod, rank) this subscriber:
- on first contact and on an engine restart (live seq going backwards) starts a new generation: it
  asks the replay socket for everything from seq 0, publishes a reset, then the replayed batches;
- on a gap asks the replay socket (a DEALER; ROUTER replies with or without the topic frame, ended by
  seq -1) for the missing range; what the buffer no longer holds becomes a reset;
- publishes every seq; the consecutive batches worked off in one go share a message
  (bridge/batch_run.py). A payload that cannot be decoded may have removed blocks, so it is never
  passed over: the generation ends there and a new one starts after it (reset ``malformed``). A
  message the stream refuses for good ends the generation the same way (reset ``refused``), and what
  the engine's buffer holds after it is published again in the new one: a hole is never left for the
  indexers to wait on;
- reads its socket ahead into a queue bounded in bytes (bridge/receive_budget.py): a batch that does
  not fit is dropped and replayed once the queue has drained, and replays too come in chunks that fit.
libzmq reconnects by itself with exponential backoff (``backoffInitial`` .. ``backoffMax``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from bridge.batch_run import BatchRun, events_size
from bridge.block_key_check import BlockKeyCheck
from bridge.l1_publisher import L1Publisher, new_generation
from bridge.receive_budget import ReceiveBudget
from bridge.vllm_events import MalformedPayload, decode_batch
from bridge.zmq_drain import drainer
from cache_indexer.metrics import Metrics
from cache_indexer.tasks import cancel_and_wait
from cache_indexer.throttled_log import ThrottledWarning
from schemas.config import L1IngestConfig
from schemas.events import MAX_SEQ

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
_NOBLOCK = int(zmq.NOBLOCK)
PUBLISH_BURST = 256  # queued batches published without yielding to the event loop
#: Messages read from libzmq without yielding: reading ahead must outpace publishing, or the backlog
#: waits in the engine's send queue (vLLM's PUB holds up to 100,000 messages in the engine's memory).
READ_BURST = 4096
#: Longest wait for libzmq's signal: a missed one costs at most this much delay.
READ_WAIT_MAX = 1.0
#: Budget bytes a batch costs beyond its frames (the tuple, the bytes objects' headers).
BATCH_OVERHEAD = 64
#: vLLM numbers batches with an int64 counter from 0, one a batch: a seq past MAX_SEQ, or more than 2^32
#: ahead of the last one (years of batches), is garbage, not a gap to replay or a reason to reset.
MAX_SEQ_JUMP = 1 << 32
#: Silence after the last replayed batch that ends a round cut short by the engine's high-water mark.
REPLAY_ROUND_IDLE = 0.1
#: Rounds of one replay at most (each within replayTimeout, each bringing something new): vLLM's buffer
#: of 10,000 batches through a high-water mark of 1,000 takes about ten; the bound keeps a replay finite.
REPLAY_MAX_ROUNDS = 64


def _contiguous(batches: list[tuple[int, bytes]], first: int) -> list[tuple[int, bytes]]:
    """The sorted ``batches`` from seq ``first`` on, up to the first missing seq."""
    out: list[tuple[int, bytes]] = []
    for seq, payload in batches:
        if seq < first + len(out):
            continue  # before the run, or the same seq twice
        if seq != first + len(out):
            break
        out.append((seq, payload))
    return out


@dataclass(slots=True)
class Replayed:
    """What one replay brought: contiguous batches, the budget bytes they hold until ``release``, and
    whether the replay stopped for want of room (the engine may hold more after the last)."""
    budget: ReceiveBudget
    batches: list[tuple[int, bytes]] = field(default_factory=list)
    held: int = 0
    cut: bool = False

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0

    def after(self, seq: int) -> list[tuple[int, bytes]]:
        return [b for b in self.batches if b[0] > seq]


@dataclass(frozen=True, slots=True)
class Endpoint:
    pod: str  # pod IP: the key the API is asked by
    rank: int
    pub: str  # tcp://host:port of the PUB socket
    replay: str | None  # tcp://host:port of the ROUTER replay socket, None when not configured
    name: str = ""
    #: Changes when the engine behind the endpoint restarts (pod uid + container restarts); a new
    #: epoch is a new endpoint, so the bridge starts a fresh subscription (reset + replay from 0).
    epoch: str = ""


class VllmSubscriber:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: Endpoint, cfg: L1IngestConfig, sink: L1Publisher,
                 metrics: Metrics, replay_slots: asyncio.Semaphore, block_key_check: BlockKeyCheck | None = None,
                 budget: ReceiveBudget | None = None) -> None:
        self.ctx = ctx
        self.ep = endpoint
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self.replay_slots = replay_slots
        self.block_key_check = block_key_check
        self.budget = budget or ReceiveBudget(cfg.maxBufferedBytes)
        #: batches read ahead of publishing, with their budget bytes
        self._queue: deque[tuple[list[bytes], int]] = deque()
        self._queued = asyncio.Event()
        #: the highest seq dropped for want of room and not yet replayed
        self._dropped_upto: int | None = None
        #: the last seq of a message the stream refused for good (of generation ``gen``), not yet handled
        self._refused_upto: int | None = None
        self._overflow_log = ThrottledWarning(log, every=10.0)
        self._reader: asyncio.Task | None = None
        self.gen: int | None = None
        self.last: int | None = None  # last seq published
        #: vLLM's timestamp of the batch published last: what tells this engine incarnation's batch at that
        #: seq from a restarted engine's (whose seq may have overtaken ours while the socket reconnected)
        self.last_ts: float | None = None
        self.last_live: int | None = None  # last seq received on the live socket
        self._last_failed_replay = float("-inf")
        self._malformed_log = ThrottledWarning(log, every=10.0)
        self._task: asyncio.Task | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task | None = None
        #: since when the SUB socket has had no connection to the engine (None: connected)
        self.disconnected_since: float | None = None
        #: the SUB socket connected again (the engine's process may be another one): the next batch that
        #: looks like a continuation is checked against the engine's replay buffer first
        self._reconnected = False
        #: batches handed on (``last`` counts them) and not yet published: sent before anything waits
        self._run_pending = BatchRun(cfg.coalesceMaxBatches, cfg.coalesceMaxBytes)
        self._published = metrics.bridge_batches.labels("published")

    # -- lifecycle ---------------------------------------------------------------------------------
    async def resume_from_stream(self) -> None:
        """Continue the generation a previous bridge published for this (pod, rank), if the engine is
        the same one (same epoch): the first live message then fills the gap by replay, no reset."""
        pos = await self.sink.last_position(self.ep.pod, self.ep.rank)
        if pos is None:
            return
        if pos.epoch != (self.ep.epoch or "-"):
            log.info("%s rank %d: engine epoch changed since the last bridge; starting fresh", self.ep.pod, self.ep.rank)
            return
        self.gen, self.last, self.last_live, self.last_ts = pos.gen, pos.seq, None, pos.ts
        log.info("%s rank %d: resuming generation %d after seq %d", self.ep.pod, self.ep.rank, pos.gen, pos.seq)

    def start_over(self) -> None:
        """The stream lost what was published: the next batch starts a new generation (a reset, then
        what the engine's replay buffer holds from seq 0)."""
        self.gen = self.last = self.last_live = self.last_ts = None
        self._run_pending.take()  # of the lost generation

    def start(self) -> None:
        self.sink.watch_refusals(self.ep.pod, self.ep.rank, self._on_refused)
        self.disconnected_since = time.monotonic()
        self.metrics.subscriptions_disconnected.inc()  # until its first connection
        self._open()
        self._task = asyncio.create_task(self._run(), name=f"vllm-sub-{self.ep.pod}-{self.ep.rank}")
        self._monitor_task = asyncio.create_task(self._watch_connection(), name=f"vllm-mon-{self.ep.pod}-{self.ep.rank}")
        self.metrics.subscriptions.inc()

    def _open(self) -> None:
        """The SUB socket (with its monitor) and the task reading it ahead into the queue."""
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.cfg.rcvHwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.maxBatchBytes)  # libzmq disconnects a peer that sends more
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.cfg.backoffInitial * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.cfg.backoffMax * 1000)))
        sock.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
                                                | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECT_DELAYED)
        sock.connect(self.ep.pub)
        self._sock = sock
        self._reader = asyncio.create_task(self._read(), name=f"vllm-read-{self.ep.pod}-{self.ep.rank}")

    async def _close_socket(self) -> None:
        await cancel_and_wait(self._reader)  # first: it reads the socket
        if self._sock is not None:
            self._sock.disable_monitor()
            self._sock.close(0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(0)
            self._monitor = None

    async def _watch_connection(self) -> None:
        """Follows the SUB socket's connection. libzmq reconnects by itself after a connection drops, and
        says so (a retry, a delayed connect) within its reconnect interval; after a protocol error, a
        message over ``maxBatchBytes`` among them, it gives the connection up without a word, and the
        engine's batches would never arrive again. Such a socket is made anew (counted in
        ``cache_indexer_bridge_resubscribes_total``); the batches missed meanwhile are a gap like any."""
        connects = 0
        given_up_after = max(1.0, 3 * self.cfg.backoffInitial)
        dropped_at: float | None = None  # a disconnection libzmq has shown no sign of repairing yet
        while True:
            wait = None if dropped_at is None else max(0.0, dropped_at + given_up_after - time.monotonic())
            try:
                event = parse_monitor_message(await asyncio.wait_for(self._monitor.recv_multipart(), wait))
            except asyncio.TimeoutError:
                self.metrics.bridge_resubscribes.inc()
                log.warning("%s rank %d: the connection to %s dropped and libzmq does not reconnect (a message over "
                            "ingest.l1.maxBatchBytes=%d, or another protocol error): subscribing again", self.ep.pod,
                            self.ep.rank, self.ep.pub, self.cfg.maxBatchBytes)
                await self._close_socket()
                self._open()
                dropped_at = None
                continue
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # the subscription is closing
            except Exception:
                log.exception("%s rank %d: unreadable socket monitor event", self.ep.pod, self.ep.rank)
                continue
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                dropped_at = None
                connects += 1
                if self.disconnected_since is not None:
                    self.disconnected_since = None
                    self.metrics.subscriptions_disconnected.dec()
                if connects > 1:
                    self._reconnected = True
                    log.info("%s rank %d: reconnected to %s", self.ep.pod, self.ep.rank, self.ep.pub)
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
        queued = zmq.Socket.shadow(sock.underlying)
        drain = drainer(queued)  # None: through pyzmq
        loop = asyncio.get_running_loop()
        signalled = asyncio.Event()
        fd = queued.get(zmq.FD)
        loop.add_reader(fd, signalled.set)
        try:
            while True:
                try:
                    signalled.clear()
                    if sock.closed:  # the bulk receive must never see a closed socket's address
                        return
                    if drain is not None:
                        for frames in drain(READ_BURST):
                            self._take(frames)
                    else:
                        self._receive_burst(queued)
                    if self._queue:
                        self._queued.set()
                    if queued.get(zmq.EVENTS) & zmq.POLLIN:
                        await asyncio.sleep(0)  # more is there: let the others run first
                        continue
                except asyncio.CancelledError:
                    raise
                except (zmq.ZMQError, OSError):  # OSError: from the bulk receive
                    if queued.closed or sock.closed:
                        return
                    log.exception("%s rank %d: receive failed", self.ep.pod, self.ep.rank)
                except Exception:
                    log.exception("%s rank %d: receive failed", self.ep.pod, self.ep.rank)
                try:  # bounded: a missed signal costs at most this much delay
                    await asyncio.wait_for(signalled.wait(), READ_WAIT_MAX)
                except asyncio.TimeoutError:
                    pass
        finally:
            loop.remove_reader(fd)

    def _receive_burst(self, queued: zmq.Socket) -> None:
        """Without the bulk receive: through pyzmq, as Frames (RCVMORE through getsockopt costs an enum
        lookup per frame, a third of a receive)."""
        recv = queued.recv
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
        self._overflow_log("%s rank %d: receive budget full (%d of ingest.l1.maxBufferedBytes=%d bytes held); "
                           "batches dropped, to be replayed", self.ep.pod, self.ep.rank, self.budget.held,
                           self.budget.limit)

    def _on_refused(self, gen: int, first: int, last: int) -> None:
        """The stream refused batches first..last of generation ``gen`` for good (told by the publisher)."""
        if gen == self.gen and (self._refused_upto is None or last > self._refused_upto):
            self._refused_upto = last
            self._queued.set()  # handled by the loop, between two bursts

    async def _after_refusal(self) -> None:
        """A new generation after the refused batches, filled from the engine's buffer (reset ``refused``):
        the indexers would otherwise hold every later batch of this worker waiting for them."""
        upto, self._refused_upto = self._refused_upto, None
        log.error("%s rank %d: the stream refused batches up to seq %d for good; starting a new generation "
                  "after them", self.ep.pod, self.ep.rank, upto)
        await self._reset(upto + 1, "refused")
        self.last = upto
        await self._drain_buffer(upto + 1, None)

    async def _run(self) -> None:
        await self._catch_up()
        while True:
            if self._refused_upto is not None:
                await self._guarded(self._after_refusal(), "starting over after a refused publish")
                continue
            if not self._queue:
                if self._dropped_upto is not None:  # the tail of a burst was dropped: replay it now
                    upto, self._dropped_upto = self._dropped_upto, None
                    if self.gen is not None and self.last is not None and upto > self.last:
                        await self._guarded(self._drain_buffer(self.last + 1, None), "replaying from the engine's buffer")
                    continue
                if self._run_pending.batches:
                    await self._guarded(self._flush(), "publishing batches")
                    continue  # the reader may have queued (and signalled) meanwhile: look again first
                self._queued.clear()
                await self._queued.wait()
                continue
            for _ in range(PUBLISH_BURST):
                if not self._queue:
                    break
                frames, size = self._queue.popleft()
                try:
                    await self._on_frames(frames)
                finally:
                    self.budget.give(size)
            await self._guarded(self._flush(), "publishing batches")
            await asyncio.sleep(0)

    async def _flush(self) -> None:
        """Publish the batches handed on so far (before anything else of this worker, and before waiting)."""
        run = self._run_pending
        if run.batches:
            decoded, block_events = run.decoded, run.block_events
            await self.sink.run(self.ep.pod, self.ep.rank, run.gen, run.take(), self.ep.epoch)
            self._published.inc(decoded)
            self.metrics.bridge_block_events.inc(block_events)

    async def _guarded(self, work, what: str) -> None:
        """Run ``work`` of the subscription's loop; a failure is logged, never the end of the loop."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s rank %d: %s failed", self.ep.pod, self.ep.rank, what)

    async def _catch_up(self) -> None:
        """A resumed subscription asks the replay socket at once for what the engine published while no
        bridge listened: an engine that has gone quiet would otherwise stay behind until its next batch.
        Live batches queue meanwhile; those already replayed are dropped as duplicates."""
        if self.gen is None or self.last is None or not self.ep.replay:
            return
        before = self.last
        try:
            same, replayed = await self._same_incarnation(empty_is_failure=False)
            if same is False:  # restarted while no bridge listened: start over from what it holds
                replayed.release()
                await self._restart_from_buffer()
                return
            await self._drain_buffer(self.last + 1, replayed)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s rank %d: catching up from the replay socket failed", self.ep.pod, self.ep.rank)
            return
        if self.last != before:
            # live batches queued meanwhile up to the new last are the same ones again, not a restart
            self.last_live = before
            log.info("%s rank %d: caught up %d batches published while no bridge listened", self.ep.pod,
                     self.ep.rank, self.last - before)

    async def _restart_from_buffer(self) -> None:
        """A new generation from what the engine's buffer holds (no live batch to start from)."""
        first = await self._replay(0, empty_is_failure=False)
        if not first.batches:
            first.release()
            return
        self._log_new_incarnation()
        start = first.batches[0][0]
        await self._reset(start, "engine-restart")
        self.last = start - 1
        await self._drain_buffer(start, first)

    async def _drain_buffer(self, want: int, replayed: Replayed | None) -> None:
        """Publish what the engine's buffer holds from ``want`` on, chunk by chunk within the budget,
        up to its first hole (a live batch after it resolves that gap)."""
        while True:
            if replayed is None:
                replayed = await self._replay(want, empty_is_failure=False)
            try:
                run = replayed.after(want - 1)
                if not run or run[0][0] != want:
                    return
                await self._publish_run(run)
                want = self.last + 1
                if not replayed.cut:
                    return
                self.metrics.bridge_replays.labels("chunk").inc()
            finally:
                replayed.release()
            replayed = None

    async def _on_frames(self, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                self.metrics.bridge_malformed.inc()
                self._malformed_log("%s rank %d: unexpected frame layout (%d frames)", self.ep.pod,
                                    self.ep.rank, len(frames))
                return
            seq = int.from_bytes(frames[1], "big")
            if seq > MAX_SEQ or (self.last is not None and seq > self.last + MAX_SEQ_JUMP):
                self.metrics.bridge_malformed.inc()  # not a gap to fill or reset for: the message is garbage
                self._malformed_log("%s rank %d: impossible seq %d after %s; batch dropped", self.ep.pod,
                                    self.ep.rank, seq, self.last)
                return
            await self.on_live(seq, frames[2])
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one message kill the subscription
            log.exception("%s rank %d: failed to handle a batch", self.ep.pod, self.ep.rank)

    # -- sequence handling ---------------------------------------------------------------------------
    async def on_live(self, seq: int, payload: bytes) -> None:
        if self.gen is None:
            await self._resync(seq, payload, want_from=0, new_gen=True, reason="subscribed")
        elif seq == self.last + 1:
            if self._reconnected:  # a continuation, or a restarted engine that reached exactly this seq
                self._reconnected = False
                same, replayed = await self._same_incarnation()
                if replayed is not None:
                    replayed.release()
                if same is False:
                    await self._new_incarnation(seq, payload)
                    return
            await self._publish(seq, payload)
            self.last = self.last_live = seq
        elif seq <= self.last:
            self._reconnected = False
            if self.last_live is None or seq <= self.last_live:
                log.info("%s rank %d: seq went back %s -> %d: engine restarted", self.ep.pod, self.ep.rank,
                         self.last_live, seq)
                await self._resync(seq, payload, want_from=0, new_gen=True, reason="engine-restart")
            else:
                self.metrics.bridge_batches.labels("duplicate").inc()  # already published from a replay
                self.last_live = seq
        else:
            self._reconnected = False
            self.metrics.bridge_gaps.inc()
            log.info("%s rank %d: gap %d..%d", self.ep.pod, self.ep.rank, self.last + 1, seq - 1)
            same, replayed = await self._same_incarnation()
            if same is False:
                replayed.release()
                await self._new_incarnation(seq, payload)
            else:
                await self._resync(seq, payload, want_from=self.last + 1, new_gen=False, reason="gap",
                                   replayed=replayed)

    async def _same_incarnation(self, empty_is_failure: bool = True) -> tuple[bool | None, Replayed | None]:
        """Does the engine still hold the batch published last, with the same vLLM timestamp? Asks the
        replay socket from that seq and returns what it holds from there on too (to be released).
        False: a new engine incarnation (another batch at that seq); None: cannot tell (no replay socket
        or timestamp: nothing asked, None; no answer, or the buffer no longer reaches back to it: the gap
        then cannot be filled, and the reset that follows drops the old blocks all the same)."""
        if self.last is None or self.last_ts is None or not self.ep.replay:
            return None, None
        replayed = await self._replay(self.last, empty_is_failure)
        if not replayed.batches or replayed.batches[0][0] != self.last:
            return None, replayed
        try:
            return decode_batch(replayed.batches[0][1]).ts == self.last_ts, replayed
        except MalformedPayload:
            return None, replayed

    async def _new_incarnation(self, seq: int, payload: bytes) -> None:
        self._log_new_incarnation()
        await self._resync(seq, payload, want_from=0, new_gen=True, reason="engine-restart")

    def _log_new_incarnation(self) -> None:
        log.warning("%s rank %d: the engine holds another batch at the seq published last (%d): a new engine "
                    "incarnation; starting a new generation from what its replay buffer holds", self.ep.pod,
                    self.ep.rank, self.last)

    async def _resync(self, live_seq: int, live_payload: bytes, want_from: int, new_gen: bool, reason: str,
                      replayed: Replayed | None = None) -> None:
        """Publish the batches from ``want_from`` up to the live one from the engine's buffer (chunk by
        chunk within the budget), then the live one. A new generation (reset) first when ``new_gen``, or
        where the buffer no longer holds the next seq wanted (``gap-beyond-replay``)."""
        want = want_from
        while want < live_seq:
            if replayed is None:
                replayed = await self._replay(want)
            try:
                run = [b for b in replayed.batches if want <= b[0] < live_seq]
                cut = replayed.cut and (not run or run[-1][0] < live_seq - 1)
                if not run or (not cut and run[-1][0] != live_seq - 1):
                    break  # the buffer does not hold the run up to the live batch: reset at the live one
                if new_gen or run[0][0] != want:
                    await self._reset(run[0][0], reason if new_gen else "gap-beyond-replay")
                    new_gen = False
                await self._publish_run(run)
                want = self.last + 1
                if cut:
                    self.metrics.bridge_replays.labels("chunk").inc()
            finally:
                replayed.release()
            replayed = None
        if replayed is not None:
            replayed.release()
        if want != live_seq or new_gen:
            await self._reset(live_seq, reason if new_gen else "gap-beyond-replay")
        await self._publish(live_seq, live_payload)
        self.last = self.last_live = live_seq

    async def _publish_run(self, run: list[tuple[int, bytes]]) -> None:
        """Replayed batches in order, yielding now and then so live batches keep being read meanwhile."""
        for i, (seq, payload) in enumerate(run, 1):
            await self._publish(seq, payload)
            self.last = seq
            if i % PUBLISH_BURST == 0:
                await asyncio.sleep(0)

    async def _reset(self, start: int, reason: str) -> None:
        await self._flush()
        self.gen = new_generation()
        await self.sink.reset(self.ep.pod, self.ep.rank, self.gen, start, reason, self.ep.epoch)
        self.metrics.bridge_resets.labels(reason).inc()

    async def _replay(self, start: int, empty_is_failure: bool = True) -> Replayed:
        """What vLLM's replay buffer holds from ``start`` on, as far as the budget has room (to be
        released); empty when unavailable. An empty answer starts the cooldown, except for a catch-up,
        where nothing new is the usual answer.

        In rounds: the engine's ROUTER drops what exceeds its send high-water mark (1,000 messages before
        vLLM 0.33) without a word, so a long answer arrives with holes (measured: 2,451 of 3,000, end
        marker included) or cut short. The unbroken run from the seq asked for is kept, and the engine is
        asked again from the first seq missing, until a round is whole up to its end marker, the buffer no
        longer reaches back that far, a round brings nothing new, the budget is full (``cut``: the caller
        asks again after publishing), or REPLAY_MAX_ROUNDS rounds were asked."""
        await self._flush()  # what was handed on goes out before waiting on the engine
        out = Replayed(self.budget)
        if not self.ep.replay:
            return out
        if time.monotonic() - self._last_failed_replay < self.cfg.replayCooldown:
            self.metrics.bridge_replays.labels("cooldown").inc()
            return out
        try:
            await self._replay_rounds(start, out)
        except BaseException:
            out.release()
            raise
        self.metrics.bridge_replays.labels("ok" if out.batches else "empty").inc()
        if not out.batches and empty_is_failure:
            self._last_failed_replay = time.monotonic()
        return out

    async def _replay_rounds(self, start: int, out: Replayed) -> None:
        rounds = 0
        async with self.replay_slots:
            want = start
            while True:
                got, complete, held, cut = await self._replay_round(want, first=not out.batches)
                rounds += 1
                if got is None:  # nothing at all within replayTimeout
                    self.metrics.bridge_replays.labels("timeout").inc()
                    log.warning("%s rank %d: replay from %d timed out after %d batches (%d rounds)", self.ep.pod,
                                self.ep.rank, start, len(out.batches), rounds)
                    self._last_failed_replay = time.monotonic()
                    break
                got.sort(key=lambda x: x[0])
                run = [] if out.batches and got and got[0][0] > want else \
                    _contiguous(got, got[0][0] if got and not out.batches else want)
                kept = sum(len(p) + BATCH_OVERHEAD for _, p in run)
                self.budget.give(held - kept)
                out.batches.extend(run)
                out.held += kept
                if cut:  # no room for more: the caller asks again once it has published these
                    out.cut = bool(out.batches)
                    break
                if (complete and len(run) == len(got)) or not run:
                    break  # whole, or nothing new (the buffer moved on meanwhile: what is missing is gone)
                if rounds >= REPLAY_MAX_ROUNDS:  # an engine that never finishes: what is missing resets
                    log.warning("%s rank %d: replay from %d still incomplete after %d rounds (%d batches)",
                                self.ep.pod, self.ep.rank, start, rounds, len(out.batches))
                    break
                want = run[-1][0] + 1  # dropped from there on (or in the middle): ask again
                self.metrics.bridge_replays.labels("round").inc()

    async def _replay_round(self, start: int, first: bool) -> tuple[list[tuple[int, bytes]] | None, bool, int, bool]:
        """One request: (batches received, whether the end marker came, budget bytes they hold, whether
        the budget had no room for more). None: no answer within replayTimeout. A round also ends once
        no message came for REPLAY_ROUND_IDLE after the last."""
        out: list[tuple[int, bytes]] = []
        held = 0
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # bounded: past it libzmq stops reading the connection and the engine's ROUTER drops past its own
        # high-water mark, which the rounds repair; unbounded, libzmq took the whole answer into memory
        sock.setsockopt(zmq.RCVHWM, max(1, self.cfg.rcvHwm))
        sock.setsockopt(zmq.MAXMSGSIZE, self.cfg.maxBatchBytes)
        try:
            sock.connect(self.ep.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.cfg.replayTimeout
            while True:
                wait = deadline - time.monotonic()
                if out:
                    wait = min(wait, REPLAY_ROUND_IDLE)
                if wait <= 0 or not await sock.poll(wait * 1000):
                    return (out if out else None), False, held, False
                frames = await sock.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # >= 0.26: topic, seq, payload
                    seq_b, payload = frames[1], frames[2]
                elif len(frames) == 2:  # < 0.26: seq, payload
                    seq_b, payload = frames
                else:
                    self.metrics.bridge_malformed.inc()
                    continue
                if seq_b == END_SEQ:
                    return out, True, held, False
                if len(seq_b) == 8:
                    size = len(payload) + BATCH_OVERHEAD
                    if not self.budget.take_replay(size, first and not out):
                        self.metrics.bridge_replays.labels("budget").inc()
                        return out, False, held, True
                    held += size
                    out.append((int.from_bytes(seq_b, "big"), payload))
        except BaseException:
            self.budget.give(held)
            raise
        finally:
            sock.close(0)

    async def _publish(self, seq: int, payload: bytes) -> None:
        """Hand a batch on: it joins the pending run (published when full, or before anything waits)."""
        try:
            check = self.block_key_check
            batch = decode_batch(payload, want_probe=check is not None and check.due(self.ep.pod))
            events, ts, decoded = batch.events, batch.ts, True
            if batch.probe is not None:
                check.offer(self.ep.pod, batch.probe)
        except MalformedPayload as exc:
            self.metrics.bridge_malformed.inc()
            self.metrics.bridge_batches.labels("malformed").inc()
            self._malformed_log("%s rank %d seq %d: malformed payload (%s): a new generation starts after it",
                                self.ep.pod, self.ep.rank, seq, exc)
            # its events (removals, a clear) are unknown: the index cannot vouch for this worker any more
            await self._reset(seq + 1, "malformed")
            self.last_ts = None
            return
        self.last_ts = ts
        n, size = events_size(events)
        run = self._run_pending
        if not run.takes(self.gen, seq, size):
            await self._flush()
        run.add(self.gen, seq, ts, events, size, n, decoded)
        if run.full():
            await self._flush()
