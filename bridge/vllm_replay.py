"""vLLM's replay socket, asked for what an engine's buffer holds from a seq on: the sequencer's
``replay`` port (bridge/l1_sequencer.py), one client per subscribed (pod, rank).

The engine's ROUTER answers ``[topic, seq, payload]`` per buffered batch (``[seq, payload]`` before vLLM
0.26) and ends with seq -1; what it cannot send within its high-water mark it drops without a word,
hence the rounds below. Replayed batches take budget bytes (bridge/receive_budget.py) until released.

The replay socket takes larger messages than the live one (``replay_max_bytes``): a batch over
``maxBatchBytes`` makes libzmq drop the live connection, and the replay that fills that gap must bring
it. With the live limit the replay broke on the same batch (libzmq gives such a connection up without a
word), timed out, and the worker was reset, the batches after it lost with it.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.l1_sequencer import Replayed
from cache_indexer.bridge.receive_budget import BATCH_OVERHEAD, ReceiveBudget
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.config import L1IngestConfig

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
#: Silence after the last replayed batch that ends a round cut short by the engine's high-water mark.
REPLAY_ROUND_IDLE = 0.1
#: Rounds of one replay at most (each within replayTimeout, each bringing something new): vLLM's buffer
#: of 10,000 batches through a high-water mark of 1,000 takes about ten; the bound keeps a replay finite.
REPLAY_MAX_ROUNDS = 64


def replay_max_bytes(cfg: L1IngestConfig) -> int:
    """The largest message a replay socket takes: the replays' share of the receive budget (half of
    ``maxBufferedBytes``, at least ``maxBatchBytes``), where the live sockets take ``maxBatchBytes``."""
    return max(cfg.maxBatchBytes, cfg.maxBufferedBytes // 2)


def _contiguous(batches: list[tuple[int, bytes]], first: int) -> list[tuple[int, bytes]]:
    """The sorted ``batches`` from seq ``first`` on, up to the first missing seq."""
    out: list[tuple[int, bytes]] = []
    for seq, payload in batches:
        if seq < first + len(out):
            continue  # before the stretch, or the same seq twice
        if seq != first + len(out):
            break
        out.append((seq, payload))
    return out


class VllmReplayClient:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: Endpoint, cfg: L1IngestConfig, budget: ReceiveBudget,
                 metrics: Metrics, slots: asyncio.Semaphore) -> None:
        self.ctx = ctx
        self.ep = endpoint
        self.log = logging.LoggerAdapter(log, {"pod": endpoint.pod, "rank": endpoint.rank})
        self.cfg = cfg
        self.budget = budget
        self.metrics = metrics
        #: replays in flight at once, across the bridge (each may take much of the budget)
        self.slots = slots
        self._last_failed = float("-inf")

    async def __call__(self, start: int, empty_is_failure: bool = True) -> Replayed:
        """What vLLM's replay buffer holds from ``start`` on, as far as the budget has room (to be
        released); empty when unavailable (the sequencer's ``replay`` port). An empty answer starts the
        cooldown, except for a catch-up, where nothing new is the usual answer.

        In rounds: the engine's ROUTER drops what exceeds its send high-water mark (1,000 messages before
        vLLM 0.33) without a word, so a long answer arrives with holes (measured: 2,451 of 3,000, end
        marker included) or cut short. The unbroken stretch from the seq asked for is kept, and the engine is
        asked again from the first seq missing, until a round is whole up to its end marker (or looks it: a
        tail dropped before the marker is the sequencer's to ask on for), the buffer no longer reaches back
        that far, a round brings nothing new, the budget is full (``cut``: the caller asks again after
        publishing), or REPLAY_MAX_ROUNDS rounds were asked."""
        out = Replayed(self.budget)
        if not self.ep.replay:
            return out
        if time.monotonic() - self._last_failed < self.cfg.replayCooldown:
            self.metrics.bridge_replays.labels("cooldown").inc()
            return out
        try:
            await self._rounds(start, out)
        except BaseException:
            out.release()
            raise
        self.metrics.bridge_replays.labels("ok" if out.batches else "empty").inc()
        if not out.batches and empty_is_failure:
            self._last_failed = time.monotonic()
        return out

    async def _rounds(self, start: int, out: Replayed) -> None:
        rounds = 0
        async with self.slots:
            want = start
            while True:
                got, complete, taken, cut = await self._round(want, first=not out.batches)
                rounds += 1
                if got is None:  # nothing at all within replayTimeout
                    self.metrics.bridge_replays.labels("timeout").inc()
                    self.log.warning("%s rank %d: replay from %d timed out after %d batches (%d rounds)", self.ep.pod,
                                     self.ep.rank, start, len(out.batches), rounds)
                    self._last_failed = time.monotonic()
                    break
                got.sort(key=lambda x: x[0])
                stretch = [] if out.batches and got and got[0][0] > want else \
                    _contiguous(got, got[0][0] if got and not out.batches else want)
                kept = sum(len(p) + BATCH_OVERHEAD for _, p in stretch)
                self.budget.give(taken - kept)
                out.batches.extend(stretch)
                out.taken += kept
                if cut:  # no room for more: the caller asks again once it has published these
                    out.cut = bool(out.batches)
                    break
                if (complete and len(stretch) == len(got)) or not stretch:
                    out.complete = complete and len(stretch) == len(got)
                    break  # whole, or nothing new (the buffer moved on meanwhile: what is missing is gone)
                if rounds >= REPLAY_MAX_ROUNDS:  # an engine that never finishes: what is missing resets
                    self.log.warning("%s rank %d: replay from %d still incomplete after %d rounds (%d batches)",
                                     self.ep.pod, self.ep.rank, start, rounds, len(out.batches))
                    break
                want = stretch[-1][0] + 1  # dropped from there on (or in the middle): ask again
                self.metrics.bridge_replays.labels("round").inc()

    async def _round(self, start: int, first: bool) -> tuple[list[tuple[int, bytes]] | None, bool, int, bool]:
        """One request: (batches received, whether the end marker came, budget bytes they hold, whether
        the budget had no room for more). None: no answer within replayTimeout. A round also ends once
        no message came for REPLAY_ROUND_IDLE after the last."""
        out: list[tuple[int, bytes]] = []
        taken = 0
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # bounded: past it libzmq stops reading the connection and the engine's ROUTER drops past its own
        # high-water mark, which the rounds repair; unbounded, libzmq took the whole answer into memory
        sock.setsockopt(zmq.RCVHWM, max(1, self.cfg.rcvHwm))
        sock.setsockopt(zmq.MAXMSGSIZE, replay_max_bytes(self.cfg))  # not the live limit: see the module
        try:
            sock.connect(self.ep.replay)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.cfg.replayTimeout
            while True:
                wait = deadline - time.monotonic()
                if out:
                    wait = min(wait, REPLAY_ROUND_IDLE)
                if wait <= 0 or not await sock.poll(wait * 1000):
                    return (out if out else None), False, taken, False
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
                    return out, True, taken, False
                if len(seq_b) == 8:
                    size = len(payload) + BATCH_OVERHEAD
                    if not self.budget.take_replay(size, first and not out):
                        self.metrics.bridge_replays.labels("budget").inc()
                        return out, False, taken, True
                    taken += size
                    out.append((int.from_bytes(seq_b, "big"), payload))
        except BaseException:
            self.budget.give(taken)
            raise
        finally:
            sock.close(0)
