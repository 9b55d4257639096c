"""Turns bridge decisions (a batch, a reset, a pod removal) into L1 stream messages.

Payloads are maps of ``schemas.events`` in the stream's encoding (msgpack, or JSON: infra/event_codec.py);
headers make ``nats stream view`` readable without a decoder. ``Nats-Msg-Id`` is ``<pod>:<rank>:<gen>:<seq>``: the generation changes whenever the engine's
sequence restarts (engine restart, unrecoverable gap, bridge restart), so a restarted engine's seq 0 is
never mistaken for a duplicate, while the same batch published twice (a retry, a replay overlap) is.
A batch over the message limit (150k hashes is 1.35 MB) goes out in parts of the same seq,
``<pod>:<rank>:<gen>:<seq>:<part>``, each with ``part``/``parts``; indexers apply them in order and
count the seq done after the last. A run of consecutive batches coalesced by the subscriber
(bridge/batch_run.py) is one message, ``<pod>:<rank>:<gen>:<first>-<last>``, with ``Kv-Seq-Last``.

What the stream acknowledges moves the worker's resume point (bridge/resume_points.py) over the
prefix of its messages that is stored whole, in publish order: a message not acked yet (or refused)
holds it back, so a bridge that resumes never skips a batch the stream does not have. A message the
stream refuses for good is told to the worker's subscriber, which starts a new generation after it
rather than leave the indexers waiting for it.

A removal (``pod_removed``, ``rank_removed``) retires the generations before its mark. A message of a
retired generation that the stream stores after the removal (a retry still in flight) would otherwise be
the worker's last message: once a purge takes the removal (or, for a rank, at once, as the rank's subject
shows the batch) a later bridge with no record resumes that retired generation, and the indexers drop
all it sends as stale. The bridge that published the removal sees that message's ack (or an older
removal's, re-sent late) come after its removal's, and publishes the removal again, after it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
from cache_indexer.bridge.resume_points import Position, ResumePoints
from cache_indexer.infra.event_codec import MSGPACK, Codec, decode
from cache_indexer.infra.streams import l1_lifecycle_subject, l1_subject, leader_answered
from cache_indexer.schemas.events import CONTENT_TYPE_L1, SCHEMA_VERSION

log = logging.getLogger(__name__)

#: Removals this bridge remembers (bounded: the stream keeps each one's mark too)
_RETIRED_KEPT = 100_000
#: Told (gen, first seq, last seq) when the stream refused a message of the worker for good.
OnRefusedBatch = Callable[[int, int, int], None]

_gen_lock = threading.Lock()
_last_gen = 0


def new_generation(*after: int) -> int:
    """A generation number larger than any this process handed out before (wall-clock nanoseconds), and
    than ``after`` (those handed out later are larger still)."""
    global _last_gen
    with _gen_lock:
        _last_gen = max(time.time_ns(), _last_gen + 1, *(g + 1 for g in after))
        return _last_gen


def _headers(content_type: str, pod: str, msg_id: str, kind: str, **extra: str) -> dict[str, str]:
    h = {"Nats-Msg-Id": msg_id, "Content-Type": content_type, "Kv-Schema": str(SCHEMA_VERSION),
         "Kv-Type": kind, "Kv-Pod": pod}
    h.update(extra)
    return h


#: What a batch message holds besides its events (type, pod, rank, gen, seq, ts, part, parts), at most.
_ENVELOPE_BYTES = 256
#: msgpack's upper bound for one uint64 hash: the run's size estimate (bridge/batch_run.py); a run over
#: the limit in the stream's encoding is cut in halves (``L1Publisher.run``)
HASH_BYTES = MSGPACK.hash_bytes


def split_events(events: list[dict], budget: int, codec: Codec = MSGPACK) -> list[list[dict]]:
    """``events`` cut into parts of at most ``budget`` encoded bytes, in order; an event too large for one
    part is cut into events of the same kind over consecutive slices of its hashes (the parent stays with
    the first slice): applied in order, the parts do what the whole batch does."""
    pieces: list[tuple[dict, int]] = []
    for ev in events:
        size = len(codec.encode(ev)) + codec.item_sep
        hashes = ev.get("hashes") or []
        if size <= budget or not hashes:
            pieces.append((ev, size))
            continue
        # what a slice holds besides its hashes (a later slice's parent is a hash), sized with their upper bound
        fixed = len(codec.encode({**ev, "hashes": [], **({"parent": (1 << 64) - 1} if "parent" in ev else {})}))
        per = max(1, (budget - codec.item_sep - max(fixed, 64)) // codec.hash_bytes)
        for i in range(0, len(hashes), per):
            piece = {**ev, "hashes": hashes[i:i + per]}
            if i and "parent" in piece:
                piece["parent"] = hashes[i - 1]
            pieces.append((piece, len(codec.encode(piece)) + codec.item_sep))
    parts: list[list[dict]] = [[]]
    room = budget
    for ev, size in pieces:
        if size > room and parts[-1]:
            parts.append([])
            room = budget
        parts[-1].append(ev)
        room -= size
    return parts


def run_message(pod: str, rank: int, gen: int, batches: list[tuple[int, float | None, list[dict]]]) -> dict:
    """The message of a run of consecutive batches (seq, ts, events): schemas.events.L1Batch with
    ``last_seq`` and ``ends``."""
    events: list[dict] = []
    ends = []
    for _, _, evs in batches:
        events.extend(evs)
        ends.append(len(events))
    return {"v": SCHEMA_VERSION, "type": "batch", "pod": pod, "rank": rank, "gen": gen, "seq": batches[0][0],
            "last_seq": batches[-1][0], "ends": ends, "ts": batches[-1][1], "events": events}


@dataclass(slots=True)
class _Retired:
    """A removal this bridge published: its mark, where the stream stored it (0: not acked yet), and the
    furthest stream sequence of a message it retired (or of an older removal) stored after it was sent."""
    mark: int
    reason: str
    stored_at: int = 0
    stray_at: int = 0
    owed: bool = False  # a publish again is due (or under way)
    #: the stray it was last published again after (the same message id again would be a duplicate: an
    #: ack of a lost stream's higher sequence must not have it published again and again)
    again_after: int = 0
    #: stored on a stream lost since (``stream_lost``): the next stray on the new one has it published again
    lost: bool = False
    #: the retired workers' messages that were in flight at the removal (queues of ``_Sent``, emptied by
    #: their acks): while one is, a removal lost with the stream is not stored anywhere it counts
    in_flight: list = field(default_factory=list)

    def strays_in_flight(self) -> bool:
        self.in_flight = [queue for queue in self.in_flight if queue]
        return bool(self.in_flight)


@dataclass(slots=True)
class _Sent:
    """A message of a worker in flight: the position it completes once stored (and all before it)."""
    gen: int
    first: int
    last: int
    epoch: str
    ts: float | None
    complete: bool  # False: a part of a batch other than the last
    stored_seq: int = 0  # the stream sequence, once acked


class L1Publisher:
    def __init__(self, publisher: JetStreamPublisher, subject_prefix: str, js=None, stream: str = "",
                 max_payload: Callable[[], int] | None = None, bridge: str = "-",
                 resume: ResumePoints | None = None, codec: Codec = MSGPACK) -> None:
        self._pub = publisher
        self._codec = codec  # the stream's encoding (nats.l1Stream.encoding)
        self._content_type = codec.content_type(CONTENT_TYPE_L1)
        self.resume = resume
        #: per worker, its messages not acked yet (or acked after one that is not), in publish order
        self._in_flight: dict[tuple[str, int], deque[_Sent]] = {}
        self._refusal_watchers: dict[tuple[str, int], OnRefusedBatch] = {}
        #: which bridge published (the Kv-Bridge header): who relayed a pod when, for operators and tests
        self._bridge = bridge
        self._prefix = subject_prefix
        self._js = js
        self._stream = stream
        #: the payload limit less what the headers take (the connected server's max_payload, the stream's
        #: maxMsgSize); a batch over it is published in parts
        self._max = max_payload or (lambda: 1 << 62)
        #: (pod, None) for a pod, (pod, rank) for one rank -> the generation its removal by this bridge
        #: retired everything before: never resumed, even while the removal is not stored yet (the indexers
        #: would drop what follows as stale once it is)
        self._retired: dict[tuple[str, int | None], _Retired] = {}
        self._republishing: set[asyncio.Task] = set()
        #: told when one of this bridge's removals is stored (the targets record keeps it until then)
        self.on_removal_stored: Callable[[], None] | None = None
        #: the generations before this began on a stream found lost (``stream_lost``; by a bridge before
        #: this one: the stream's ``streams.LOST_BEFORE``): what they stored is gone, so none is resumed (a
        #: pod away then, whose batch a retry stored on the new stream, would otherwise resume without it)
        self.lost_before = -1
        #: told (with the stream's name) when a resume record names a position past the stream's end
        self.on_stream_lost: Callable[[str], None] | None = None
        #: the stream's last sequence as last read here (``_past_the_end``)
        self._stream_end = 0

    async def last_position(self, pod: str, rank: int) -> Position | None:
        """Where a bridge resumes (pod, rank): the resume record (within a generation, what followed it comes
        again from the engine's buffer, deduplicated); where the worker has no record, the stream's last
        message on its subject (the seq before a batch whose parts are not all in; ``tail_checked`` False:
        the sequencer publishes the buffer up to it again). None when the stream holds a generation newer
        than the record, when nothing is known, and when a ``pod_removed`` (or ``rank_removed``) retired
        its generation (the pod gone longer than the grace: the indexers retired that generation, so the
        pod that came back starts a new one rather than publish batches they drop as stale), also while
        this bridge's own removal is not stored yet."""
        recorded = await self.resume.load(pod) if self.resume is not None else None
        best = recorded.get(rank) if recorded is not None else None
        if best is not None and best.stream_seq > self._stream_end and await self._past_the_end(best.stream_seq):
            log.info("%s rank %d: its resume record's position is on a stream lost since: a new generation", pod,
                     rank, extra={"pod": pod, "rank": rank})
            return None
        from_stream = await self._stream_position(pod, rank)
        if from_stream is not None and from_stream.gen < 0:
            log.info("%s rank %d: the rank was removed after its last batch: a new generation", pod, rank,
                     extra={"pod": pod, "rank": rank})
            return None
        if from_stream is not None and best is None:
            best = from_stream  # no record of the worker (the first start after an upgrade)
        own = self.resume.own(pod, rank) if self.resume is not None else None
        if own is not None and best is not None and own.gen > best.gen:
            # this bridge saw a newer generation acked than the record (not written yet) or the stream's last
            # message shows (an older generation's, stored late: a pod back twice before the first write)
            best = own
        elif from_stream is not None and best is not None and from_stream.gen > best.gen:
            # a generation younger than the record's last write (ingest.l1.resumeInterval): the stream's
            # last message may lie past one that never made it, the record never does. Starting anew loses
            # nothing so young
            return None
        if best is not None and best.gen < self.lost_before:
            log.info("%s rank %d: generation %d began on a stream lost since: a new generation", pod, rank, best.gen,
                     extra={"pod": pod, "rank": rank})
            return None
        # this bridge's removals, and those the resume record keeps (any bridge's, also purged from the stream)
        retired = max(self._mark(pod, None), self._mark(pod, rank),
                      self.resume.retired(pod, rank) + 1 if self.resume is not None else -1)
        if best is not None and best.gen < retired:
            log.info("%s rank %d: removed after generation %d: a new generation", pod, rank, best.gen,
                     extra={"pod": pod, "rank": rank})
            return None
        started = max((sent.gen for sent in self._in_flight.get((pod, rank), ())), default=-1)
        if best is not None and best.gen < started:
            # this bridge started a newer generation (its messages not stored yet: a flap while NATS is slow):
            # the older one goes on nowhere, its batches stale once the newer reset is stored
            log.info("%s rank %d: generation %d is newer than the stream's and not stored yet: a new generation",
                     pod, rank, started, extra={"pod": pod, "rank": rank})
            return None
        if best is None or self._js is None:
            if best is None:
                log.info("%s rank %d: no resume record and no message on the stream: a new generation at its "
                         "first batch", pod, rank, extra={"pod": pod, "rank": rank})
            return best
        try:
            removed = await self._js.get_last_msg(self._stream, l1_lifecycle_subject(self._prefix, pod))
        except Exception:  # never removed
            removed = None
        if removed is not None:
            # the removal retired the generations before its mark, even one whose batch the stream stored
            # after it (a retry). One stored after the position may be an older removal re-sent late, and a
            # newer one before it in the stream may have retired the position's generation: it is not
            # resumed either (an older bridge's removal, without a mark, retired all before it)
            mark = (removed.headers or {}).get("Kv-Gen", "")
            if removed.seq > best.stream_seq or (mark.isdigit() and best.gen < int(mark)):
                log.info("%s rank %d: the pod was removed after its last batch: a new generation", pod, rank,
                         extra={"pod": pod, "rank": rank})
                return None  # the pod left discovery after that batch: indexers retired its generation
        return best

    async def _past_the_end(self, stream_seq: int) -> bool:
        """Whether the stream ends before ``stream_seq``, a position a resume record of it (by its name)
        holds: it lost its messages and kept its name while no bridge was there to see its acks go back
        (every bridge restarted across the loss). The bridge is told: it names the stream anew and starts
        every engine over (``Bridge._restore_streams``)."""
        if self._js is None:
            return False
        try:
            info = await self._js.stream_info(self._stream)
        except Exception:  # unreadable now: the record is used, as before
            return False
        if not leader_answered(info):
            return False
        self._stream_end = max(self._stream_end, info.state.last_seq)
        if info.state.last_seq >= stream_seq:
            return False
        log.error("stream %s ends at seq %d, before a position a resume record of it holds (%d): it lost its "
                  "messages", self._stream, info.state.last_seq, stream_seq)
        if self.on_stream_lost is not None:
            self.on_stream_lost(self._stream)
        return True

    async def _stream_position(self, pod: str, rank: int) -> Position | None:
        """From the stream's last message on the worker's subject (None: none, or unreadable)."""
        if self._js is None:
            return None
        try:
            msg = await self._js.get_last_msg(self._stream, l1_subject(self._prefix, pod, rank))
        except Exception:  # no message on the subject (or the stream is unreachable)
            return None
        h = msg.headers or {}
        if h.get("Kv-Type") == "rank_removed":  # retired after its last batch (last_position: it starts anew)
            return Position(-1, -1, "-", None, msg.seq, tail_checked=False)
        try:
            gen, seq = int(h["Kv-Gen"]), int(h.get("Kv-Seq-Last") or h["Kv-Seq"])
            part, parts = (int(x) for x in h.get("Kv-Part", "1/1").split("/"))
        except (KeyError, ValueError):
            return None
        ts = None
        if h.get("Kv-Type") == "reset":
            seq -= 1  # a reset names the next seq
        elif part < parts:
            seq -= 1  # a batch whose later parts never made it: it is published again, whole
        else:
            try:
                ts = decode(msg.data).get("ts")
            except Exception:  # an undecodable message: resume without the incarnation check
                ts = None
        return Position(gen, seq, h.get("Kv-Epoch", "-"), ts if isinstance(ts, float) else None, msg.seq,
                        tail_checked=False)

    def watch_refusals(self, pod: str, rank: int, callback: OnRefusedBatch | None) -> None:
        """``callback`` is told of the worker's messages the stream refused for good (None: no longer)."""
        if callback is None:
            self._refusal_watchers.pop((pod, rank), None)
        else:
            self._refusal_watchers[(pod, rank)] = callback

    def _track(self, pod: str, rank: int, sent: _Sent):
        """Callbacks for one message of a worker: its ack moves the resume point over what is stored whole."""
        key = (pod, rank)
        queue = self._in_flight.get(key)
        if queue is None:
            queue = self._in_flight[key] = deque()
        while queue and queue[0].gen < sent.gen:  # a new generation supersedes what the old one still awaits
            queue.popleft()
        queue.append(sent)

        def stored(stream_seq: int) -> None:
            sent.stored_seq = stream_seq
            pos = None
            while queue and queue[0].stored_seq:
                done = queue.popleft()
                if done.complete:
                    pos = done
            if pos is not None and self.resume is not None:
                self.resume.update(pod, rank, Position(pos.gen, pos.last, pos.epoch, pos.ts, pos.stored_seq))
            if not queue and self._in_flight.get(key) is queue:  # not a newer generation's, since a removal
                self._in_flight.pop(key, None)
            self._retired_message(pod, rank, sent.gen, stream_seq)

        def refused() -> None:  # stays in the queue: the position never passes it
            watcher = self._refusal_watchers.get(key)
            if watcher is not None:
                watcher(sent.gen, sent.first, sent.last)
        return stored, refused

    async def batch(self, pod: str, rank: int, gen: int, seq: int, ts: float | None, events: list[dict],
                    epoch: str = "") -> None:
        msg = {"v": SCHEMA_VERSION, "type": "batch", "pod": pod, "rank": rank, "gen": gen, "seq": seq, "ts": ts,
               "events": events}
        payload = self._codec.encode(msg)
        limit = self._max()
        parts = [events] if len(payload) <= limit else split_events(
            events, limit - _ENVELOPE_BYTES - self._codec.str_bytes(pod), self._codec)
        for i, part in enumerate(parts):
            extra = {}
            if len(parts) > 1:
                payload = self._codec.encode({**msg, "events": part, "part": i, "parts": len(parts)})
                extra["Kv-Part"] = f"{i + 1}/{len(parts)}"
            msg_id = f"{pod}:{rank}:{gen}:{seq}" + (f":{i}" if len(parts) > 1 else "")
            sent = _Sent(gen, seq, seq, epoch or "-", ts, i == len(parts) - 1)
            await self._publish_batch(pod, rank, gen, seq, epoch, part, msg_id, payload, extra, sent)

    async def run(self, pod: str, rank: int, gen: int, batches: list[tuple[int, float | None, list[dict]]],
                  epoch: str = "") -> None:
        """Consecutive batches (seq, ts, events) of one generation as one message (``last_seq``, ``ends``:
        schemas/events.py); one that would not fit the message limit goes out as two halves, down to
        single batches (which may still go out in parts)."""
        if len(batches) == 1:
            seq, ts, events = batches[0]
            await self.batch(pod, rank, gen, seq, ts, events, epoch)
            return
        msg = run_message(pod, rank, gen, batches)
        events, first, last = msg["events"], msg["seq"], msg["last_seq"]
        payload = self._codec.encode(msg)
        if len(payload) > self._max():
            half = len(batches) // 2
            await self.run(pod, rank, gen, batches[:half], epoch)
            await self.run(pod, rank, gen, batches[half:], epoch)
            return
        await self._publish_batch(pod, rank, gen, first, epoch, events, f"{pod}:{rank}:{gen}:{first}-{last}", payload,
                                  {"Kv-Seq-Last": str(last)}, _Sent(gen, first, last, epoch or "-", msg["ts"], True))

    async def _publish_batch(self, pod: str, rank: int, gen: int, seq: int, epoch: str, events: list[dict],
                             msg_id: str, payload: bytes, extra: dict[str, str], sent: _Sent) -> None:
        kinds = ",".join(sorted({e["kind"] for e in events}))
        extra.update({"Kv-Dp-Rank": str(rank), "Kv-Gen": str(gen), "Kv-Seq": str(seq), "Kv-Epoch": epoch or "-",
                      "Kv-Events": str(len(events)), "Kv-Kinds": kinds or "-", "Kv-Bridge": self._bridge})
        stored, refused = self._track(pod, rank, sent)
        await self._pub.publish(l1_subject(self._prefix, pod, rank), payload,
                                _headers(self._content_type, pod, msg_id, "batch", **extra),
                                stored, refused)

    async def reset(self, pod: str, rank: int, gen: int, next_seq: int, reason: str, epoch: str = "",
                    again: bool = False) -> None:
        """A generation's first message (``again``: published again by a bridge that resumed it, whose ack
        moves no position: it names no vLLM timestamp, and a record of it would start the worker anew)."""
        payload = self._codec.encode({"v": SCHEMA_VERSION, "type": "reset", "pod": pod, "rank": rank, "gen": gen,
                                 "next_seq": next_seq, "reason": reason})
        headers = _headers(self._content_type, pod, f"{pod}:{rank}:{gen}:reset", "reset", **{
            "Kv-Dp-Rank": str(rank), "Kv-Gen": str(gen), "Kv-Seq": str(next_seq), "Kv-Epoch": epoch or "-",
            "Kv-Reason": reason, "Kv-Bridge": self._bridge})
        stored, refused = self._track(pod, rank, _Sent(gen, next_seq - 1, next_seq - 1, epoch or "-", None, not again))
        await self._pub.publish(l1_subject(self._prefix, pod, rank), payload, headers, stored, refused)

    def _retire(self, pod: str, rank: int | None, reason: str) -> int:
        """The mark of a removal of the pod (or one rank of it): a generation after every one this bridge
        published or resumed for it, and before any it starts later (a pod back, a rank listed again)."""
        known = [sent.gen for (p, r), queue in self._in_flight.items() if p == pod and rank in (None, r)
                 for sent in queue]
        if self.resume is not None:
            known += self.resume.generations(pod, rank)
        mark = new_generation(*known)
        if len(self._retired) >= _RETIRED_KEPT:  # the oldest first (a pod's removal long stored is on the stream)
            del self._retired[next(iter(self._retired))]
        before = self._retired.pop((pod, rank), None)
        in_flight = [self._in_flight.pop(key) for key in [k for k in self._in_flight if k[0] == pod and rank in (None, k[1])]]
        if rank is None:  # and what its ranks' removals retired: a rank kept alone is dropped with its pod
            in_flight += [q for (p, r), e in self._retired.items() if p == pod and r is not None for q in e.in_flight]
        self._retired[(pod, rank)] = _Retired(mark, reason, in_flight=in_flight + (before.in_flight if before else []))
        return mark

    def _mark(self, pod: str, rank: int | None) -> int:
        r = self._retired.get((pod, rank))
        return -1 if r is None else r.mark

    def _retired_message(self, pod: str, rank: int | None, gen: int, stream_seq: int) -> None:
        """An ack of a message of a generation before a removal's mark (a batch, a reset, or an older
        removal): stored after the removal, the removal goes out again."""
        for key in ((pod, None), (pod, rank)) if rank is not None else ((pod, None),):
            r = self._retired.get(key)
            if r is not None and gen < r.mark:
                r.stray_at = max(r.stray_at, stream_seq)
                self._owe(key, r)

    def _removal_stored(self, key: tuple[str, int | None], mark: int, stream_seq: int) -> None:
        r = self._retired.get(key)
        if r is None:
            return
        if mark < r.mark:  # an older removal of the same pod (or rank), stored late
            self._retired_message(key[0], key[1], mark, stream_seq)
            return
        first = not r.stored_at
        r.stored_at = max(r.stored_at, stream_seq)
        r.lost = False
        self._owe(key, r)
        if first and self.on_removal_stored is not None:
            self.on_removal_stored()

    def unstored_removals(self) -> set[tuple[str, int | None]]:
        """(pod, None) and (pod, rank) of this bridge's removals the stream has not stored yet, or stored on a
        stream lost since while a message they retired is still in flight: that message may be stored on
        the new one, and a bridge killed before its ack would leave it there for good (and, once one was
        stored there, until the removal published again is)."""
        return {key for key, r in self._retired.items()
                if not r.stored_at and (not r.lost or r.stray_at or r.strays_in_flight())}

    def stream_lost(self, found_at: int | None = None) -> None:
        """The stream was created again (the loss found at generation ``found_at``, else now): no generation
        begun before is resumed, and where it stored this bridge's removals and their strays means nothing
        on the new one. A removal is published again once a message it retired (a retry) is stored on the
        new stream, or where one acked before may have been: the indexers rebuilt from it would otherwise
        take that message in."""
        self.lost_before = max(self.lost_before, new_generation() if found_at is None else found_at)
        self._stream_end = 0
        if self.resume is not None:
            self.resume.stream_lost()
        for key, r in self._retired.items():
            # A retired message acked before the loss was noticed may be the new stream's (the ack that told
            # of the loss, say) though its sequence lies below where the lost stream stored the removal: its
            # sequence cannot tell. The removal goes out again on the new stream (where that message was the
            # lost stream's, a removal of nothing)
            unsure = r.stored_at and r.again_after < r.stray_at <= r.stored_at
            r.lost = r.lost or r.stored_at > 0
            r.stored_at = r.again_after = 0
            r.stray_at = r.stray_at if unsure else 0
            if unsure:
                self._owe(key, r)

    def _owe(self, key: tuple[str, int | None], r: _Retired) -> None:
        if r.owed or r.stray_at <= r.again_after or not r.lost and (not r.stored_at or r.stray_at <= r.stored_at):
            return
        r.owed = True
        log.info("%s%s: a message of a retired generation was stored after its removal: published again",
                 key[0], "" if key[1] is None else f" rank {key[1]}", extra={"pod": key[0]})
        try:
            task = asyncio.get_running_loop().create_task(self.republish_owed())
        except RuntimeError:  # no loop (a caller that drives the publisher itself calls republish_owed)
            return
        self._republishing.add(task)
        task.add_done_callback(self._republished)

    def _republished(self, task: asyncio.Task) -> None:
        self._republishing.discard(task)
        if not task.cancelled() and task.exception() is not None:  # never silently
            log.error("publishing a removal again failed", exc_info=task.exception())

    async def republish_owed(self) -> None:
        """Each removal that a retired message was stored after goes out again, with the same mark."""
        for key, r in list(self._retired.items()):
            if r.owed:
                r.owed, r.again_after = False, r.stray_at
                await self._publish_removal(key, r.mark, r.reason, f"after:{r.stray_at}")

    async def rank_removed(self, pod: str, rank: int, reason: str, after: int | None = None) -> None:
        """One rank of the pod left while the pod stays (unregistered alone, ``dpRanks`` shrunk): its resume
        position goes first, then the message that retires that rank's generation in every indexer, on the
        rank's own subject (so a bridge that finds it there starts the rank anew). ``after``: the stream
        sequence of the last message it follows, which names the message (sharded bridges publish a
        removal again until they see it: bridge/removals.py); None: named by its mark."""
        mark = self._retire(pod, rank, reason)
        if self.resume is not None:
            await self.resume.forget_rank(pod, rank, mark)
        await self._publish_removal((pod, rank), mark, reason, mark if after is None else f"after:{after}")

    async def pod_removed(self, pod: str, reason: str, after: int | None = None) -> None:
        """The pod left: its resume record goes first (so no bridge resumes the retired generation), then
        the message that retires it in every indexer. ``after``: as for ``rank_removed``."""
        mark = self._retire(pod, None, reason)
        if self.resume is not None:
            await self.resume.forget(pod, mark)
        await self._publish_removal((pod, None), mark, reason, mark if after is None else f"after:{after}")

    async def _publish_removal(self, key: tuple[str, int | None], mark: int, reason: str, tail) -> None:
        """``pod_removed`` on the pod's lifecycle subject (rank None), else ``rank_removed`` on the rank's."""
        pod, rank = key
        def stored(stream_seq: int) -> None:
            self._removal_stored(key, mark, stream_seq)
        if rank is None:
            payload = self._codec.encode({"v": SCHEMA_VERSION, "type": "pod_removed", "pod": pod,
                                          "reason": reason, "gen": mark})
            headers = _headers(self._content_type, pod, f"{pod}:removed:{tail}", "pod_removed",
                               **{"Kv-Gen": str(mark), "Kv-Reason": reason, "Kv-Bridge": self._bridge})
            await self._pub.publish(l1_lifecycle_subject(self._prefix, pod), payload, headers, stored)
            return
        payload = self._codec.encode({"v": SCHEMA_VERSION, "type": "rank_removed", "pod": pod, "rank": rank,
                                      "reason": reason, "gen": mark})
        headers = _headers(self._content_type, pod, f"{pod}:{rank}:removed:{tail}", "rank_removed",
                           **{"Kv-Dp-Rank": str(rank), "Kv-Gen": str(mark), "Kv-Reason": reason,
                              "Kv-Bridge": self._bridge})
        await self._pub.publish(l1_subject(self._prefix, pod, rank), payload, headers, stored)
