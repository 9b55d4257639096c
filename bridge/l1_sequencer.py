"""The sequence decisions of one vLLM endpoint, without sockets.

vLLM numbers its batches per engine process from 0 and keeps the last ones in a replay buffer. From the
live batches, what the replay buffer answers and what the stream acknowledged, this decides per (pod,
rank) what the stream gets:
- on first contact and on an engine restart (live seq going backwards, or another batch than ours at
  the seq published last) a new generation: a reset, then what the engine's buffer holds from seq 0
  (a first contact with a buffer that holds nothing: the reset alone, ``idle``);
- on a gap, the missing batches from the replay buffer; what it no longer holds becomes a reset
  (``gap-beyond-replay``);
- a resumed generation (a restarted or standby bridge, bridge/resume_points.py) goes on where the
  stream stands, catching up at once from the buffer; an engine whose buffer no longer holds the batch
  published last cannot be told from a restarted one, and is never continued (reset ``unverified``);
- every seq is published; consecutive batches worked off in one go share a message (bridge/batch_run.py).
  A payload that cannot be decoded may have removed blocks, so it is never passed over: the generation
  ends there and a new one starts after it (reset ``malformed``). A message the stream refuses for good
  ends the generation the same way (reset ``refused``), and what the engine's buffer holds after it is
  published again in the new one: a hole is never left for the indexers to wait on.
The subscriber (bridge/vllm_subscriber.py) does the I/O: it reads the socket, asks the replay socket
(the ``replay`` port) and hands each batch here; the sink is the L1 publisher. So the decisions can be
driven alone, against a model of the engines and the stream (tests/test_sequencing_model.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec

from cache_indexer.bridge.batch_run import BatchRun, events_size
from cache_indexer.bridge.block_key_check import BlockKeyCheck
from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.l1_publisher import L1Publisher, new_generation
from cache_indexer.bridge.receive_budget import ReceiveBudget
from cache_indexer.bridge.resume_points import Position
from cache_indexer.bridge.vllm_events import MalformedPayload, decode_batch, decode_current, may_hold_probe
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.events import MAX_SEQ

log = logging.getLogger(__name__)

PUBLISH_BURST = 256  # replayed batches published without yielding to the event loop
#: vLLM numbers batches with an int64 counter from 0, one a batch: a seq past MAX_SEQ, or more than 2^32
#: ahead of the last one (years of batches), is garbage, not a gap to replay or a reason to reset.
MAX_SEQ_JUMP = 1 << 32
#: What the engine's buffer says when it holds later batches but not the one published last: which
#: engine process it is cannot be told, so a continuation is never assumed (a new generation starts).
MOVED_ON = "moved-on"
#: How far back from a position taken from the stream the engine's buffer is published again (vLLM keeps
#: 10,000 batches): the previous bridge's messages in flight, stored in any order, lie within it.
TAIL_DEPTH = 10_000


@dataclass(slots=True)
class Replayed:
    """What one replay brought: contiguous batches, the budget bytes they hold until ``release``, whether
    the replay stopped for want of room (the engine may hold more after the last), and whether the engine's
    end marker came (an empty answer then means it holds nothing from there on; a tail dropped on the way
    before the marker still looks whole)."""
    budget: ReceiveBudget
    batches: list[tuple[int, bytes]] = field(default_factory=list)
    taken: int = 0
    cut: bool = False
    complete: bool = False

    def release(self) -> None:
        self.budget.give(self.taken)
        self.taken = 0

    def after(self, seq: int) -> list[tuple[int, bytes]]:
        return [b for b in self.batches if b[0] > seq]

    def ends_before(self, seq: int) -> bool:
        """Whether its last batch is the one right before ``seq`` (an answer that may have been cut there)."""
        return bool(self.batches) and self.batches[-1][0] == seq - 1


#: The engine's replay buffer: (start seq, whether an empty answer is a failure) -> what it holds from there.
ReplaySource = Callable[[int, bool], Awaitable[Replayed]]


class L1Sequencer:
    def __init__(self, endpoint: Endpoint, sink: L1Publisher, metrics: Metrics, replay: ReplaySource,
                 max_batches: int, max_bytes: int, block_key_check: BlockKeyCheck | None = None) -> None:
        self.ep = endpoint
        self.log = logging.LoggerAdapter(log, {"pod": endpoint.pod, "rank": endpoint.rank})
        self.sink = sink
        self.metrics = metrics
        self._ask = replay
        self.block_key_check = block_key_check
        self.gen: int | None = None
        self.last: int | None = None  # last seq published
        #: vLLM's timestamp of the batch published last: what tells this engine incarnation's batch at that
        #: seq from a restarted engine's (whose seq may have overtaken ours while the socket reconnected)
        self.last_ts: float | None = None
        self.last_live: int | None = None  # last seq received on the live socket
        #: the SUB socket connected again (the engine's process may be another one): the next batch that
        #: looks like a continuation is checked against the engine's replay buffer first
        self.reconnected = False
        #: the last seq of a message the stream refused for good (of generation ``gen``), not yet handled
        self.refused_upto: int | None = None
        #: the first seq of a generation started on first contact, until a live batch from there on came: a
        #: live batch before it was on its way meanwhile (not a restart): the live path starts over from it
        self.contact_start: int | None = None
        #: the resume position came from the stream's last message (no record): the catch-up publishes the
        #: engine's buffer up to it again, filling a message the previous bridge never got stored
        self.tail_unchecked = False
        self._malformed_log = ThrottledWarning(log, every=10.0)
        #: batches handed on (``last`` counts them) and not yet published: sent before anything waits
        self.pending = BatchRun(max_batches, max_bytes)
        self._published = metrics.bridge_batches.labels("published")

    def resume(self, pos: Position | None) -> None:
        """Continue the generation a previous bridge published for this (pod, rank), if the engine is
        the same one (same epoch): the first live message then fills the gap by replay, no reset."""
        if pos is None:
            return
        if pos.epoch != (self.ep.epoch or "-"):
            self.log.info("%s rank %d: engine epoch changed since the last bridge; starting fresh", self.ep.pod,
                          self.ep.rank)
            return
        if pos.ts is None:  # a reset, or a batch cut off in parts: which engine process it was cannot be checked
            self.log.info("%s rank %d: the stream's position (generation %d, seq %d) carries no vLLM timestamp to check the "
                          "engine against; starting a new generation from its buffer", self.ep.pod, self.ep.rank, pos.gen,
                          pos.seq)
            return
        self.gen, self.last, self.last_live, self.last_ts = pos.gen, pos.seq, None, pos.ts
        self.tail_unchecked = not pos.tail_checked
        self.log.info("%s rank %d: resuming generation %d after seq %d%s", self.ep.pod, self.ep.rank, pos.gen, pos.seq,
                      "" if pos.tail_checked else " (the stream's last message: no resume record)")

    def start_over(self) -> None:
        """The stream lost what was published: the next batch starts a new generation (a reset, then
        what the engine's replay buffer holds from seq 0)."""
        self.gen = self.last = self.last_live = self.last_ts = None
        self.refused_upto = None  # what the lost stream refused: the new generation starts before it
        self.pending.take()  # of the lost generation

    def refused(self, gen: int, first: int, last: int) -> bool:
        """The stream refused batches first..last of generation ``gen`` for good (told by the publisher);
        True when the subscriber is to call ``after_refusal``."""
        if gen == self.gen and (self.refused_upto is None or last > self.refused_upto):
            self.refused_upto = last
            return True
        return False

    async def after_refusal(self) -> None:
        """A new generation after the refused batches, filled from the engine's buffer (reset ``refused``):
        the indexers would otherwise hold every later batch of this worker waiting for them."""
        upto, self.refused_upto = self.refused_upto, None
        self.log.error("%s rank %d: the stream refused batches up to seq %d for good; starting a new generation "
                       "after them", self.ep.pod, self.ep.rank, upto)
        await self._reset(upto + 1, "refused")
        self.last = upto
        await self.publish_buffered(upto + 1, None)

    async def flush(self) -> None:
        """Publish the batches handed on so far (before anything else of this worker, and before waiting)."""
        run = self.pending
        if run.batches:
            batches, block_events = len(run.batches), run.block_events
            await self.sink.run(self.ep.pod, self.ep.rank, run.gen, run.take(), self.ep.epoch)
            self._published.inc(batches)
            self.metrics.bridge_block_events.inc(block_events)

    async def catch_up(self, first_contact: bool = True) -> None:
        """A resumed subscription asks the replay socket at once for what the engine published while no
        bridge listened: an engine that has gone quiet would otherwise stay behind until its next batch.
        A new one (first contact: discovered, registered, or a new generation after a removal) starts its
        generation from what the engine's buffer holds, at once, while no live batch waits
        (``first_contact``; one that waits starts it, its buffer asked from seq 0 up to it): an engine
        registered while idle was invisible until it published again. Live batches queue meanwhile;
        those already replayed are dropped as duplicates."""
        if not self.ep.replay:
            return
        if self.gen is None:
            if first_contact:
                await self._first_contact()
            return
        if self.last is None:
            return
        before = self.last
        try:
            same, replayed = await self._same_incarnation(empty_is_failure=False)
            if same is False:  # restarted while no bridge listened: start over from what it holds
                replayed.release()
                await self._restart_from_buffer()
                return
            if same == MOVED_ON:
                await self._start_at_buffer(replayed, self._moved_on_reason(replayed))
                return
            if same is None:  # not told (a restarted engine may hold nothing yet): the next batch is checked
                self.reconnected = True
            elif self.tail_unchecked:
                replayed.release()
                replayed = await self._rewind_to_tail()
            await self.publish_buffered(self.last + 1, replayed)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("%s rank %d: catching up from the replay socket failed", self.ep.pod, self.ep.rank)
            return
        if self.last != before:
            # live batches queued meanwhile up to the new last are the same ones again, not a restart
            self.last_live = before
            self.log.info("%s rank %d: caught up %d batches published while no bridge listened", self.ep.pod,
                          self.ep.rank, self.last - before)

    async def _first_contact(self) -> None:
        """A new generation from the engine's buffer, before any live batch. An engine whose buffer holds
        nothing starts it at once too, with its reset: the indexers may hold a generation of this worker
        that could not be resumed. One that does not answer (or not whole) starts it at its first live batch."""
        try:
            first = await self._replay(0, empty_is_failure=False)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("%s rank %d: asking the replay socket on first contact failed", self.ep.pod,
                               self.ep.rank)
            return
        if not first.batches or self.gen is not None:
            first.release()
            if self.gen is None and first.complete:
                # The buffer holds nothing: the reset now. What the indexers hold of a generation this bridge
                # did not resume (begun on a stream lost since, its retries stored on the new one; a position
                # with no vLLM timestamp; another epoch) would otherwise stay until the engine's first batch,
                # and for the whole grace where the pod leaves again first. A buffer holds an engine's last
                # batches, so this process has published none: its cache is empty, and the generation starts
                # at its seq 0, whichever batch of it comes first (one after a 0 lost on the way is a gap,
                # filled from the buffer). Its own reason: nothing the engine holds is lost (``subscribed``
                # counts generations begun where a resume point could not be used)
                await self._reset(0, "idle")
                self.last = self.last_live = -1
                self.last_ts = None
                self.contact_start = None  # (of an earlier first contact: seq 0 continues this generation)
            return
        self.log.info("%s rank %d: first contact: seq %d..%d from the engine's buffer", self.ep.pod, self.ep.rank,
                      first.batches[0][0], first.batches[-1][0])
        start = first.batches[0][0]
        await self._start_at_buffer(first, "subscribed")
        self.contact_start = start

    async def _rewind_to_tail(self) -> Replayed:
        """The position is the stream's last message of this worker, with no record behind it (the first
        start after an upgrade, a bridge killed before its first record write). The dead bridge's
        publishes in flight were stored in any order, so a batch before that message may never have been
        stored: the engine's buffer is asked from up to TAIL_DEPTH before it, and ``last`` goes back to
        just before the first batch it holds, so that the catch-up publishes them again (the indexers
        skip what they have and fill what they lack) and their acks record the position. The
        generation's reset goes again first, from that batch: the one in flight may be what was never
        stored, and the indexers, which then began the generation at the stored message, would take the
        batches before it for duplicates. Where it was stored, it is a duplicate (its message id within
        JetStream's window, or a reset the indexers have seen) and changes nothing."""
        self.tail_unchecked = False
        upto = self.last
        replayed = await self._replay(max(0, upto - TAIL_DEPTH), empty_is_failure=False)
        if replayed.batches and replayed.batches[0][0] <= upto:
            first = replayed.batches[0][0]
            await self.sink.reset(self.ep.pod, self.ep.rank, self.gen, first, "resumed", self.ep.epoch, again=True)
            self.last = first - 1
            self.log.info("%s rank %d: publishing seq %d..%d again (resumed from the stream's last message)",
                          self.ep.pod, self.ep.rank, first, upto)
        return replayed

    async def _restart_from_buffer(self) -> None:
        """A new generation from what the restarted engine's buffer holds (no live batch to start from);
        one that holds nothing yet gets its reset now, its cache being empty, and seq 0 next."""
        first = await self._replay(0, empty_is_failure=False)
        self._log_new_incarnation()
        if not first.batches:
            first.release()
            await self._reset(0, "engine-restart")
            self.last = self.last_live = -1
            self.last_ts = None
            return
        await self._start_at_buffer(first, "engine-restart")

    async def _start_at_buffer(self, replayed: Replayed, reason: str) -> None:
        """A new generation from the first batch ``replayed`` holds, then the rest of the buffer. Live batches
        queued meanwhile up to the new last are the same ones again, not a restart."""
        start = replayed.batches[0][0]
        try:
            await self._reset(start, reason)
        except BaseException:
            replayed.release()
            raise
        self.last = self.last_live = start - 1
        await self.publish_buffered(start, replayed)

    def _moved_on_reason(self, replayed: Replayed) -> str:
        """Why a buffer without the batch published last starts a generation: batches missing in between
        (``gap-beyond-replay``), or none missing but the engine process not told (``unverified``)."""
        return "unverified" if replayed.batches[0][0] == self.last + 1 else "gap-beyond-replay"

    async def publish_buffered(self, want: int, replayed: Replayed | None) -> None:
        """Publish what the engine's buffer holds from ``want`` on, chunk by chunk within the budget,
        up to its first hole (a live batch after it resolves that gap). Every answer that brings batches
        is asked on from its last: one cut for want of room or without its end marker, and one that looks
        whole, since a tail dropped before the marker looks whole and the quiet engine a catch-up is for
        sends no live batch whose gap would bring it; so is, once, an answer that ends right before
        ``want`` (the incarnation check's, cut after its first batch). An answer that brings nothing ends
        it; each round that goes on publishes at least one batch."""
        asked_past_end = False

        async def take(start: int, replayed: Replayed) -> bool:
            nonlocal asked_past_end
            stretch = replayed.after(start - 1)
            if stretch and stretch[0][0] == start:
                await self._publish_replayed(stretch)
                return True
            ask = not asked_past_end and replayed.ends_before(start)
            asked_past_end = True
            return ask
        await self._through_buffer(want, replayed, take, empty_is_failure=False)

    async def replay_tail(self, upto: int) -> bool:
        """The batches after the last published up to ``upto``, which the subscriber dropped for want of
        room, from the engine's buffer. True once they are published, or settled: a buffer that moved on
        past them starts a new generation from what it holds (``gap-beyond-replay``); an answer cut short
        is asked on from its last batch. False when the engine did not give them (no answer, the cooldown
        after a failed replay): the caller asks again later, as an engine that goes idle after a burst
        sends no live batch whose gap would bring them (seen at 2,000 ranks: a fleet's fill ended with 9M
        of 50M entries held)."""
        async def take(start: int, replayed: Replayed) -> bool:
            stretch = replayed.after(start - 1)
            if not stretch:
                return False
            if stretch[0][0] != start:
                await self._reset(stretch[0][0], "gap-beyond-replay")
            await self._publish_replayed(stretch)
            return self.last < upto  # an answer cut short: ask on
        if self.last is not None and self.last < upto:
            await self._through_buffer(self.last + 1, None, take, empty_is_failure=False)
        return self.last is None or self.last >= upto

    async def _through_buffer(self, want: int, replayed: Replayed | None,
                              take: Callable[[int, Replayed], Awaitable[bool]], empty_is_failure: bool = True) -> None:
        """The chunk loop over the engine's buffer: ask it from ``want`` (the first answer may be at hand),
        let ``take(want, answer)`` publish from the answer and say whether to go on (it was cut short: for
        want of room, or on the way), and ask again from the seq after the last published. Each answer is
        released after."""
        while True:
            if replayed is None:
                replayed = await self._replay(want, empty_is_failure)
            try:
                go_on = await take(want, replayed)
            finally:
                replayed.release()
            if not go_on:
                return
            self.metrics.bridge_replays.labels("chunk").inc()
            want, replayed = self.last + 1, None

    async def on_message(self, seq: int, payload: bytes) -> None:
        """A live batch as it came off the socket: a seq no vLLM can have is garbage (counted, dropped),
        never a gap to replay or a reason to reset."""
        if seq > MAX_SEQ or (self.last is not None and seq > self.last + MAX_SEQ_JUMP):
            self.metrics.bridge_malformed.inc()
            self._malformed_log("%s rank %d: impossible seq %d after %s; batch dropped", self.ep.pod,
                                self.ep.rank, seq, self.last)
            return
        await self.on_live(seq, payload)

    # -- sequence handling ---------------------------------------------------------------------------
    async def on_live(self, seq: int, payload: bytes) -> None:
        contact, self.contact_start = self.contact_start, None
        if self.gen is None or (contact is not None and seq < contact):
            # (a live batch older than the buffer a first contact started from: the engine was busy after
            # all, and its live batches hold more than its buffer did; they start the generation anew)
            await self._resync(seq, payload, want_from=0, new_gen=True, reason="subscribed")
        elif seq == self.last + 1:
            if self.reconnected:  # a continuation, or a restarted engine that reached exactly this seq
                self.reconnected = False
                same, replayed = await self._same_incarnation()
                if replayed is not None:
                    replayed.release()
                if same is False:
                    await self._new_incarnation(seq, payload)
                    return
                if same == MOVED_ON:  # nothing missing, but whose batch this is cannot be told
                    await self._resync(seq, payload, want_from=seq, new_gen=True, reason="unverified")
                    return
            await self._publish(seq, payload)
            self.last = self.last_live = seq
        elif seq <= self.last:
            reconnected, self.reconnected = self.reconnected, False
            if self.last_live is None or seq <= self.last_live:
                self.log.info("%s rank %d: seq went back %s -> %d: engine restarted", self.ep.pod, self.ep.rank,
                              self.last_live, seq)
                await self._resync(seq, payload, want_from=0, new_gen=True, reason="engine-restart")
                return
            if reconnected:  # a batch published from a replay already, or a restarted engine's
                same, replayed = await self._same_incarnation()
                if replayed is not None:
                    replayed.release()
                if same is False or same == MOVED_ON:  # the same process would still hold up to this one
                    await self._new_incarnation(seq, payload)
                    return
            self.metrics.bridge_batches.labels("duplicate").inc()  # already published from a replay
            self.last_live = seq
        else:
            self.reconnected = False
            self.metrics.bridge_gaps.inc()
            self.log.info("%s rank %d: gap %d..%d", self.ep.pod, self.ep.rank, self.last + 1, seq - 1)
            same, replayed = await self._same_incarnation()
            if same is False:
                replayed.release()
                await self._new_incarnation(seq, payload)
            elif same == MOVED_ON and self._moved_on_reason(replayed) == "unverified":
                await self._resync(seq, payload, want_from=self.last + 1, new_gen=True, reason="unverified",
                                   replayed=replayed)
            else:  # a buffer that moved on further: the gap cannot be filled (gap-beyond-replay)
                await self._resync(seq, payload, want_from=self.last + 1, new_gen=False, reason="gap",
                                   replayed=replayed)

    async def _same_incarnation(self, empty_is_failure: bool = True) -> tuple[bool | str | None, Replayed | None]:
        """Does the engine still hold the batch published last, with the same vLLM timestamp? Asks the
        replay socket from that seq and returns what it holds from there on too (to be released).
        False: a new engine incarnation (another batch at that seq, or a whole answer holding nothing from
        it on); MOVED_ON: its buffer holds only later batches (the same process after a long while, or a
        restarted one: not told, never continued); None: cannot tell (no replay socket or timestamp: nothing
        asked, None; no answer)."""
        if self.last is None or self.last_ts is None or not self.ep.replay:
            return None, None
        replayed = await self._replay(self.last, empty_is_failure)
        if not replayed.batches:  # holding nothing from the seq it published: another process (if it answered)
            return (False if replayed.complete else None), replayed
        if replayed.batches[0][0] > self.last:
            return MOVED_ON, replayed
        if replayed.batches[0][0] != self.last:
            return None, replayed
        try:
            return decode_batch(replayed.batches[0][1]).ts == self.last_ts, replayed
        except MalformedPayload:
            return None, replayed

    async def _new_incarnation(self, seq: int, payload: bytes) -> None:
        self._log_new_incarnation()
        await self._resync(seq, payload, want_from=0, new_gen=True, reason="engine-restart")

    def _log_new_incarnation(self) -> None:
        self.log.warning("%s rank %d: the engine holds another batch at the seq published last (%d): a new engine "
                         "incarnation; starting a new generation from what its replay buffer holds", self.ep.pod,
                         self.ep.rank, self.last)

    async def _resync(self, live_seq: int, live_payload: bytes, want_from: int, new_gen: bool, reason: str,
                      replayed: Replayed | None = None) -> None:
        """Publish the batches from ``want_from`` up to the live one from the engine's buffer (chunk by
        chunk within the budget), then the live one. A new generation (reset) first when ``new_gen``, or
        where the buffer no longer holds the next seq wanted (``gap-beyond-replay``). An answer that ends
        before the live one is asked on from its last batch: the engine's ROUTER drops past its send
        high-water mark and may have room again for the end marker, so an answer can look whole without
        its tail (a buffer only ever loses its oldest batches)."""
        want, reset_reason = want_from, (reason if new_gen else None)
        checked = replayed  # the incarnation check's answer, from the seq published last

        async def take(start: int, replayed: Replayed) -> bool:
            nonlocal want, reset_reason
            stretch = [b for b in replayed.batches if start <= b[0] < live_seq]
            if not stretch:  # none before the live one: reset at it; unless the incarnation check's answer
                # was cut short right after the seq published last: ask on (once: the next answer is from start)
                return replayed is checked and start - 1 == self.last and replayed.ends_before(start)
            if reset_reason or stretch[0][0] != start:
                await self._reset(stretch[0][0], reset_reason or "gap-beyond-replay")
                reset_reason = None
            await self._publish_replayed(stretch)
            want = self.last + 1
            return want < live_seq  # an answer cut short (no room, or a tail its ROUTER dropped): ask on
        if want < live_seq:
            await self._through_buffer(want, replayed, take)
        elif replayed is not None:
            replayed.release()
        if want != live_seq or reset_reason:
            await self._reset(live_seq, reset_reason or "gap-beyond-replay")
        await self._publish(live_seq, live_payload)
        self.last = self.last_live = live_seq

    async def _publish_replayed(self, stretch: list[tuple[int, bytes]]) -> None:
        """Replayed batches in order, yielding now and then so live batches keep being read meanwhile."""
        for i, (seq, payload) in enumerate(stretch, 1):
            await self._publish(seq, payload)
            self.last = seq
            if i % PUBLISH_BURST == 0:
                await asyncio.sleep(0)

    async def _reset(self, start: int, reason: str) -> None:
        await self.flush()
        self.gen = new_generation(self.sink.lost_before)  # after a stream loss's mark, on any host's clock
        await self.sink.reset(self.ep.pod, self.ep.rank, self.gen, start, reason, self.ep.epoch)
        self.metrics.bridge_resets.labels(reason).inc()

    async def _replay(self, start: int, empty_is_failure: bool = True) -> Replayed:
        """What the engine's buffer holds from ``start`` on (to be released); what was handed on goes out
        before waiting on the engine."""
        await self.flush()
        return await self._ask(start, empty_is_failure)

    async def _publish(self, seq: int, payload: bytes) -> None:
        """Hand a batch on: it joins the pending run (published when full, or before anything waits)."""
        try:
            check = self.block_key_check
            batch = decode_batch(payload, want_probe=check is not None and check.due(self.ep.pod))
            events, ts = batch.events, batch.ts
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
        if not self._join(seq, ts, events):
            await self.flush()
            self._join(seq, ts, events)  # an empty run takes any batch
        if self.pending.full():
            await self.flush()

    def _join(self, seq: int, ts: float | None, events: list[dict]) -> bool:
        """The batch joins the pending run; False where the run must be published first."""
        n, size = events_size(events)
        if not self.pending.takes(self.gen, seq, size):
            return False
        self.last_ts = ts
        self.pending.add(self.gen, seq, ts, events, size, n)
        return True

    def take_usual(self, seq: int, payload: bytes) -> bool:
        """The usual live batch without a coroutine (four fewer a batch: a third of the bridge's CPU for
        one-event batches): the next seq of a settled subscription, vLLM's current shape, no blockKey probe
        wanted from it (none due, or the batch cannot hold one: on a real fleet nearly every store has a
        parent, and a due check stays due until a probe comes), room in the pending run. True: handed on as
        ``on_message`` would (publish the run when it is full); False: nothing changed, ``on_message``
        decides."""
        if self.gen is None or self.reconnected or self.last is None or seq != self.last + 1 or seq > MAX_SEQ:
            return False
        try:
            batch = decode_current(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, MalformedPayload):
            return False  # another shape, or garbage: the tolerant decoder decides
        check = self.block_key_check
        if check is not None and check.due(self.ep.pod) and may_hold_probe(batch.events):
            return False  # the probe's path decodes it again (only while a check is due)
        if not self._join(seq, batch.ts, batch.events):
            return False
        self.last = self.last_live = seq
        return True
