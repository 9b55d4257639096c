"""One vLLM KV-event publisher endpoint (a pod's data-parallel rank): ZMQ SUB, sequence tracking, replay.

vLLM sends ``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` with seq counting from 0 per
engine process. Per (pod, rank) this subscriber:
- on first contact and on an engine restart (live seq going backwards) starts a new generation: it
  asks the replay socket for everything from seq 0, publishes a reset, then the replayed batches;
- on a gap asks the replay socket (a DEALER; ROUTER replies with or without the topic frame, ended by
  seq -1) for the missing range; what the buffer no longer holds becomes a reset;
- publishes one message per seq, an empty one for a malformed payload, so the stream stays contiguous.
libzmq reconnects by itself with exponential backoff (``backoffInitial`` .. ``backoffMax``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from bridge.block_key_check import BlockKeyCheck
from bridge.l1_publisher import L1Publisher, new_generation
from bridge.vllm_events import MalformedPayload, decode_batch
from cache_indexer.metrics import Metrics
from cache_indexer.tasks import cancel_and_wait
from cache_indexer.throttled_log import ThrottledWarning
from schemas.config import L1IngestConfig

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
RECV_BURST = 256  # messages taken without yielding to the event loop
#: vLLM numbers batches with an int64 counter from 0, one a batch: a seq past 2^63, or more than 2^32
#: ahead of the last one (years of batches), is garbage, not a gap to replay or a reason to reset.
MAX_SEQ = (1 << 63) - 1
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
                 metrics: Metrics, replay_slots: asyncio.Semaphore, block_key_check: BlockKeyCheck | None = None) -> None:
        self.ctx = ctx
        self.ep = endpoint
        self.cfg = cfg
        self.sink = sink
        self.metrics = metrics
        self.replay_slots = replay_slots
        self.block_key_check = block_key_check
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
        #: the SUB socket connected again (the engine's process may be another one): the next batch that
        #: looks like a continuation is checked against the engine's replay buffer first
        self._reconnected = False

    # -- lifecycle ---------------------------------------------------------------------------------
    async def resume_from_stream(self) -> None:
        """Continue the generation a previous bridge published for this (pod, rank), if the engine is
        the same one (same epoch): the first live message then fills the gap by replay, no reset."""
        pos = await self.sink.last_position(self.ep.pod, self.ep.rank)
        if pos is None:
            return
        gen, last, epoch, ts = pos
        if epoch != (self.ep.epoch or "-"):
            log.info("%s rank %d: engine epoch changed since the last bridge; starting fresh", self.ep.pod, self.ep.rank)
            return
        self.gen, self.last, self.last_live, self.last_ts = gen, last, None, ts
        log.info("%s rank %d: resuming generation %d after seq %d", self.ep.pod, self.ep.rank, gen, last)

    def start_over(self) -> None:
        """The stream lost what was published: the next batch starts a new generation (a reset, then
        what the engine's replay buffer holds from seq 0)."""
        self.gen = self.last = self.last_live = self.last_ts = None

    def start(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.cfg.rcvHwm)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(self.cfg.backoffInitial * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(self.cfg.backoffMax * 1000)))
        sock.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
        self._monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        sock.connect(self.ep.pub)
        self._sock = sock
        self._task = asyncio.create_task(self._run(), name=f"vllm-sub-{self.ep.pod}-{self.ep.rank}")
        self._monitor_task = asyncio.create_task(self._watch_connects(), name=f"vllm-mon-{self.ep.pod}-{self.ep.rank}")
        self.metrics.subscriptions.inc()

    async def _watch_connects(self) -> None:
        connects = 0
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # the subscription is closing
            except Exception:
                log.exception("%s rank %d: unreadable socket monitor event", self.ep.pod, self.ep.rank)
                continue
            if event["event"] == zmq.EVENT_CONNECTED:
                connects += 1
                if connects > 1:
                    self._reconnected = True
                    log.info("%s rank %d: reconnected to %s", self.ep.pod, self.ep.rank, self.ep.pub)

    async def stop(self) -> None:
        """Also when the caller is cancelled meanwhile (a bridge stopping while a pod is being removed):
        the socket is closed in any case, or the bridge's ``ctx.term()`` would wait for it for ever."""
        try:
            if self._task:
                task, self._task = self._task, None
                self.metrics.subscriptions.dec()
                await cancel_and_wait(task, self._monitor_task)
        finally:
            if self._sock is not None:
                self._sock.disable_monitor()
                self._sock.close(0)
                self._sock = None
            if self._monitor is not None:
                self._monitor.close(0)
                self._monitor = None

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        # What is already queued is taken with plain non-blocking receives on a shadow of the same
        # socket: each awaited receive of zmq.asyncio costs a future and poller bookkeeping, which was
        # the bridge's largest cost per batch under load. A burst is bounded so others get the loop.
        queued = zmq.Socket.shadow(sock.underlying)
        await self._catch_up()
        while True:
            await self._on_frames(await sock.recv_multipart())
            for _ in range(RECV_BURST):
                try:
                    frames = queued.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._on_frames(frames)

    async def _catch_up(self) -> None:
        """A resumed subscription asks the replay socket at once for what the engine published while no
        bridge listened: an engine that has gone quiet would otherwise stay behind until its next batch.
        Live batches queue on the socket meanwhile; those already replayed are dropped as duplicates."""
        if self.gen is None or self.last is None or not self.ep.replay:
            return
        try:
            same, replayed = await self._same_incarnation(empty_is_failure=False)
            if same is False:  # restarted while no bridge listened: start over from what it holds
                latest = await self._replay(0, empty_is_failure=False)
                if latest:
                    await self._new_incarnation(*latest[-1])
                return
            if replayed is None:  # no timestamp to check against: ask for what follows
                replayed = await self._replay(self.last + 1, empty_is_failure=False)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s rank %d: catching up from the replay socket failed", self.ep.pod, self.ep.rank)
            return
        caught, before = 0, self.last
        for s, p in replayed:
            if s <= self.last:
                continue
            if s != self.last + 1:
                break  # the buffer no longer holds the next one: the first live batch resolves the gap
            await self._publish(s, p)
            self.last = s
            caught += 1
        if caught:
            # live batches queued meanwhile up to the new last are the same ones again, not a restart
            self.last_live = before
            log.info("%s rank %d: caught up %d batches published while no bridge listened", self.ep.pod,
                     self.ep.rank, caught)

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
                if (await self._same_incarnation())[0] is False:
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
                await self._new_incarnation(seq, payload)
            else:
                if replayed is not None:  # already asked: what follows the last published batch
                    replayed = [r for r in replayed if r[0] > self.last]
                await self._resync(seq, payload, want_from=self.last + 1, new_gen=False, reason="gap",
                                   replayed=replayed)

    async def _same_incarnation(self, empty_is_failure: bool = True) -> tuple[bool | None, list[tuple[int, bytes]] | None]:
        """Does the engine still hold the batch published last, with the same vLLM timestamp? Asks the
        replay socket from that seq and returns what it holds from there on too. False: a new engine
        incarnation (another batch at that seq); None: cannot tell (no replay socket or timestamp: nothing
        asked, None; no answer: []; the buffer no longer reaches back to it: the gap then cannot be
        filled, and the reset that follows drops the old blocks all the same)."""
        if self.last is None or self.last_ts is None or not self.ep.replay:
            return None, None
        replayed = await self._replay(self.last, empty_is_failure)
        if not replayed:
            return None, []
        first, payload = replayed[0]
        if first != self.last:
            return None, replayed
        try:
            return decode_batch(payload).ts == self.last_ts, replayed
        except MalformedPayload:
            return None, replayed

    async def _new_incarnation(self, seq: int, payload: bytes) -> None:
        log.warning("%s rank %d: the engine holds another batch at the seq published last (%d): a new engine "
                    "incarnation; starting a new generation from what its replay buffer holds", self.ep.pod,
                    self.ep.rank, self.last)
        await self._resync(seq, payload, want_from=0, new_gen=True, reason="engine-restart")

    async def _resync(self, live_seq: int, live_payload: bytes, want_from: int, new_gen: bool, reason: str,
                      replayed: list[tuple[int, bytes]] | None = None) -> None:
        run: list[tuple[int, bytes]] = []
        if want_from < live_seq:
            if replayed is None:
                replayed = await self._replay(want_from)
            # keep the contiguous run that ends right before the live message
            for s, p in replayed:
                if s >= live_seq:
                    break
                if run and s != run[-1][0] + 1:
                    run = []
                run.append((s, p))
            if run and run[-1][0] != live_seq - 1:
                run = []
        covered = want_from == live_seq or (bool(run) and run[0][0] == want_from)
        if new_gen or not covered:
            if not new_gen:
                reason = "gap-beyond-replay"
            self.gen = new_generation()
            start = run[0][0] if run else live_seq
            await self.sink.reset(self.ep.pod, self.ep.rank, self.gen, start, reason, self.ep.epoch)
            self.metrics.bridge_resets.labels(reason).inc()
        for s, p in run:
            await self._publish(s, p)
        await self._publish(live_seq, live_payload)
        self.last = self.last_live = live_seq

    async def _replay(self, start: int, empty_is_failure: bool = True) -> list[tuple[int, bytes]]:
        """Everything vLLM's replay buffer holds from ``start`` on; empty when unavailable. An empty
        answer starts the cooldown, except for a catch-up, where nothing new is the usual answer.

        In rounds: the engine's ROUTER drops what exceeds its send high-water mark (1,000 messages before
        vLLM 0.33) without a word, so a long answer arrives with holes (measured: 2,451 of 3,000, end
        marker included) or cut short. The unbroken run from the seq asked for is kept, and the engine is
        asked again from the first seq missing, until a round is whole up to its end marker, the buffer no
        longer reaches back that far, a round brings nothing new, or REPLAY_MAX_ROUNDS rounds were asked."""
        if not self.ep.replay:
            return []
        if time.monotonic() - self._last_failed_replay < self.cfg.replayCooldown:
            self.metrics.bridge_replays.labels("cooldown").inc()
            return []
        out: list[tuple[int, bytes]] = []
        rounds = 0
        async with self.replay_slots:
            want = start
            while True:
                got, complete = await self._replay_round(want)
                rounds += 1
                if got is None:  # nothing at all within replayTimeout
                    self.metrics.bridge_replays.labels("timeout").inc()
                    log.warning("%s rank %d: replay from %d timed out after %d batches (%d rounds)", self.ep.pod,
                                self.ep.rank, start, len(out), rounds)
                    self._last_failed_replay = time.monotonic()
                    break
                got.sort(key=lambda x: x[0])
                if out and got and got[0][0] > want:
                    break  # the buffer moved on meanwhile: what is missing is gone
                run = _contiguous(got, got[0][0] if got and not out else want)
                out.extend(run)
                if (complete and len(run) == len(got)) or not run:
                    break
                if rounds >= REPLAY_MAX_ROUNDS:  # an engine that never finishes: what is missing resets
                    log.warning("%s rank %d: replay from %d still incomplete after %d rounds (%d batches)",
                                self.ep.pod, self.ep.rank, start, rounds, len(out))
                    break
                want = run[-1][0] + 1  # dropped from there on (or in the middle): ask again
                self.metrics.bridge_replays.labels("round").inc()
        self.metrics.bridge_replays.labels("ok" if out else "empty").inc()
        if not out and empty_is_failure:
            self._last_failed_replay = time.monotonic()
        return out

    async def _replay_round(self, start: int) -> tuple[list[tuple[int, bytes]] | None, bool]:
        """One request: (batches received, whether the end marker came). None: no answer within
        replayTimeout. A round also ends once no message came for REPLAY_ROUND_IDLE after the last."""
        out: list[tuple[int, bytes]] = []
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # drops, if any, are the engine's: ours would be silent too
        try:
            sock.connect(self.ep.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.cfg.replayTimeout
            while True:
                wait = deadline - time.monotonic()
                if out:
                    wait = min(wait, REPLAY_ROUND_IDLE)
                if wait <= 0 or not await sock.poll(wait * 1000):
                    return (out if out else None), False
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
                    return out, True
                if len(seq_b) == 8:
                    out.append((int.from_bytes(seq_b, "big"), payload))
        finally:
            sock.close(0)

    async def _publish(self, seq: int, payload: bytes) -> None:
        try:
            check = self.block_key_check
            batch = decode_batch(payload, want_probe=check is not None and check.due(self.ep.pod))
            events, ts = batch.events, batch.ts
            outcome = "published"
            if batch.probe is not None:
                check.offer(self.ep.pod, batch.probe)
        except MalformedPayload as exc:
            self.metrics.bridge_malformed.inc()
            self._malformed_log("%s rank %d seq %d: malformed payload: %s", self.ep.pod, self.ep.rank, seq, exc)
            events, ts, outcome = [], None, "malformed"
        self.last_ts = ts
        await self.sink.batch(self.ep.pod, self.ep.rank, self.gen, seq, ts, events, self.ep.epoch)
        self.metrics.bridge_batches.labels(outcome).inc()
        n = 0
        for e in events:
            n += len(e.get("hashes", ())) or 1
        self.metrics.bridge_block_events.inc(n)
