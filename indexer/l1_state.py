"""Applies L1 stream messages to the index, in each (pod, rank)'s own order.

The stream is the source of truth and every replica applies the same rules to the same message order,
so replicas agree. The rules make the index robust to what a retrying publisher can do to order:
- a batch carries (gen, seq); per worker only ``seq == next`` is applied, lower seqs are duplicates;
  a run of coalesced batches (seq .. last_seq) that overlaps what was applied applies only the rest;
- a batch that arrives early (seq > next) waits (``early``) until the missing ones arrive; once the first
  was stored by the stream more than EARLY_TIMEOUT_NS before the message being applied (any worker's: the
  stream's own clock, so every replica decides alike) and the missing ones are still not in the stream,
  they are declared lost: the worker is cleared and resumes at the first early seq. A worker is never
  frozen by one message that does not come;
- at most ``max_early`` early messages of a worker are held in memory (``early_window``: twice the
  bridge's publish window, as the service sets it). Where the stream sequence of each message is known
  (the service), the ones past that are *spilled*: the cursor keeps only their position and stream
  sequence (``spilled``), and when the cursor reaches one, it is read back from the stream
  (``read_back_due``: the service gets that stream message and applies it with ``read_back=True``),
  each once. What a replica holds, spills and reads back is a function of the stream alone, so replicas
  still agree; a gap is never declared lost because the held messages are many, only by stream time
  (issue 36: a nats-server restart under a busy engine made 1,025 later batches arrive before the bridge
  re-sent the lost ones, and the worker was cleared although the stream held every batch). Without
  stream sequences (benchmarks, unit tests) too many held messages still declare the gap lost, as
  before;
- a ``reset`` (or a batch of a newer generation) clears the worker and starts the new generation;
  anything of an older generation is stale and dropped;
- a generation whose batches arrive before its reset (the reset's publish was lost and re-sent after the
  ack timeout, while later batches were stored) is applied from its first batch provisionally, and the
  messages applied are kept (a journal, at most ``max_journal`` of them (``max_early`` unless told) and
  EARLY_TIMEOUT_NS of stream time;
  none where stored times are unknown, as in benchmarks): when the reset then names an earlier
  first seq, the worker is cleared and rebuilt in seq order from there, the journal going back to the
  early messages, so the late batches before it are not taken for duplicates;
- ``pod_removed`` clears every rank of the pod (``rank_removed`` one rank of it); later batches of the same
  generations are dropped. One with a mark (``gen``: the bridge's clock when it removed the pod) retires
  only the generations before it, whatever order the stream stores them in: a generation the pod started
  after it (back from a flap, its messages stored first by a retry) stays, and a message of an older one
  stored after it, of any rank, is stale;
- a generation far ahead of the time the stream stored the message, or a seq no vLLM can reach, is
  refused (ImplausibleMessage): the stream is not trusted blindly, one forged message must not blind
  a pod for ever. The stored time, not the local clock, decides, so every replica decides alike.
GPU events (medium GPU or absent) change L1, the index the seed API's ``l1_hit_ratio`` reads. vLLM's KV
offloading (OffloadingConnector, simple_kv_offload) publishes the same hashes with medium ``CPU`` or
``STORAGE``: each has its own index over the same workers (``media``), with the same rules (a hash
stored twice is held until removed twice: chunk events re-announce shared hashes), read by ``/query``.
A ``cleared`` event clears its own medium; a reset, a lost gap or a removed pod clear them all. Other
media are counted (``ignored_medium``) and dropped.
"""

from __future__ import annotations

import logging
from array import array
from collections import deque
from dataclasses import dataclass, field

from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.indexer.block_index import BlockIndex, TierIndex, TooManyWorkers, new_block_index
from cache_indexer.schemas.events import GEN_MAX_AHEAD_NS, MAX_GROUP_IDX, MAX_SEQ, last_seq, run_error

log = logging.getLogger(__name__)

_DEAD = (1 << 64) - 1  # next_seq of a removed pod: every batch of its generation is stale (a uint64,
#                       so snapshots can encode it)
#: The rank of a pod's removal mark (a cursor no batch has; snapshots keep it with the others): a rank
#: first seen after the removal starts only with a generation newer than the mark
_POD = -1
#: How long (stream time) early batches wait for a missing one before it is declared lost. Publishes are
#: re-sent every ack timeout (5 s) until stored; this leaves room for several rounds of it.
EARLY_TIMEOUT_NS = 30 * 10**9
#: The media of vLLM's KV offloading indexed beside the GPU (HostPinned and Disk in Dynamo's words)
OFFLOAD_MEDIA = ("CPU", "STORAGE")
#: Early messages a worker holds in memory by default (L1State without a publish window to go by)
DEFAULT_MAX_EARLY = 1024
#: Read-backs a replica remembers for the purge floor (``purge_floor``); past that it vouches only for
#: the ones it kept
_READ_BACKS_KEPT = 1 << 16


def early_window(publish_window: int) -> int:
    """Early messages of one worker an indexer holds in memory before it spills the rest to be read back
    from the stream: at least twice the bridge's publish window (``nats.publish.window``). A message lost
    in flight (a nats-server killed) is re-sent at the reconnection or at its ack deadline; what the
    stream stores before it is at most what was in flight with it (the window) plus what the bridge
    published since, so this holds the usual case in memory, and the spill keeps the rest lossless."""
    return max(DEFAULT_MAX_EARLY, 2 * publish_window)


@dataclass(slots=True)
class _Cursor:
    gen: int
    next_seq: int
    reset_seen: bool = False
    #: early arrivals by (seq, part): a batch over the message limit comes in parts of one seq
    early: dict[tuple[int, int], dict] = field(default_factory=dict)
    next_part: int = 0
    #: messages applied since this generation began without its reset (None: the reset came first, or
    #: the journal outgrew max_journal): what a late reset naming an earlier first seq rebuilds from
    journal: list[dict] | None = None
    #: when the stream stored the message that made ``early`` non-empty (0: not known)
    early_since: int = 0
    #: when the stream stored the generation's first message (the journal is kept EARLY_TIMEOUT_NS at most)
    journal_since: int = 0
    #: early arrivals not held in memory (``max_early`` were) by (seq, part): (stream seq, last seq), read
    #: back from the stream when the cursor reaches them
    spilled: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)

    def advance(self, msg: dict) -> None:
        part = msg.get("part", 0)
        if part + 1 < msg.get("parts", 1):
            self.next_part = part + 1
        else:
            self.next_seq, self.next_part = last_seq(msg) + 1, 0

    def take_early(self) -> tuple[dict, int] | None:
        """The early message that goes on from (next_seq, next_part), and how many of its events were
        applied before (a run that overlaps what came before it); None when it has not arrived."""
        msg = self.early.pop((self.next_seq, self.next_part), None)
        if msg is not None:
            return msg, 0
        if self.next_part:
            return None
        for pos, msg in self.early.items():  # only a run that starts earlier can go on from here
            if pos[0] < self.next_seq <= last_seq(msg):
                del self.early[pos]
                return msg, msg["ends"][self.next_seq - pos[0] - 1]
        return None


@dataclass(slots=True)
class ApplyStats:
    batches: int = 0
    duplicates: int = 0
    stale: int = 0
    early: int = 0
    lost_gaps: int = 0
    spilled: int = 0  # early messages not held in memory (read back from the stream later)
    read_back: int = 0  # messages read back from the stream
    resets: int = 0
    block_events: int = 0
    ignored_medium: int = 0
    malformed_events: int = 0  # outside the schema (the bridge validates; a forged message may not be)


class ImplausibleMessage(ValueError):
    pass


class MalformedMessage(ValueError):
    """A batch with an event outside the schema: refused whole, before any of it is applied."""


_BLOCK_KINDS = ("stored", "removed")


def checked_events(events) -> list[array | None]:
    """Each event's hashes as uint64s (None for ``cleared``), every event checked before any is applied:
    the kind, the KV-cache group, the hashes (ints within uint64). MalformedMessage names the first event
    outside the schema (the bridge validates; a forged or corrupted message may not be)."""
    if type(events) is not list:
        raise MalformedMessage(f"events is a {type(events).__name__}, not a list")
    out: list[array | None] = []
    for i, ev in enumerate(events):
        if type(ev) is not dict:
            raise MalformedMessage(f"event {i} is a {type(ev).__name__}, not a map")
        kind, group = ev.get("kind"), ev.get("group_idx")
        if group is not None and not (type(group) is int and 0 <= group <= MAX_GROUP_IDX):
            raise MalformedMessage(f"event {i}: group_idx {group!r} outside 0..{MAX_GROUP_IDX}")
        if kind == "cleared":
            out.append(None)
            continue
        if kind not in _BLOCK_KINDS:
            raise MalformedMessage(f"event {i}: unknown kind {kind!r}")
        hashes = ev.get("hashes")
        if type(hashes) is array and hashes.typecode == "Q":  # read as uint64s already (event_codec.decode_packed)
            out.append(hashes)
            continue
        if type(hashes) is not list:
            raise MalformedMessage(f"event {i}: hashes is a {type(hashes).__name__}, not a list")
        try:
            out.append(array("Q", hashes))
        except (TypeError, OverflowError):
            raise MalformedMessage(f"event {i}: a block hash is not a uint64") from None
    return out


class L1State(TierIndex):
    def __init__(self, max_early: int = DEFAULT_MAX_EARLY, max_journal: int | None = None) -> None:
        super().__init__()
        self.cursors: dict[tuple[str, int], _Cursor] = {}
        #: pod -> the ranks it has cursors for (``knows`` looks at those, not at every worker's)
        self._pod_ranks: dict[str, set[int]] = {}
        self.max_early = max(1, max_early)
        self.max_journal = self.max_early if max_journal is None else max_journal
        self.stats = ApplyStats()
        #: workers with early batches -> when the first was stored (for EARLY_TIMEOUT_NS)
        self._waiting: dict[tuple[str, int], int] = {}
        self._now = 0  # stored time of the message being applied (0: unknown)
        self._seq = 0  # stream sequence of the message being applied (0: unknown: nothing is spilled)
        #: workers whose cursor reached a spilled message (to be read back now), in the order they did
        self._read_back: dict[tuple[str, int], None] = {}
        self._live_seq = 0  # stream sequence of the last message applied as it came (not read back)
        #: (the message applied when it was read back, its own stream sequence) of recent read-backs: a
        #: replica behind this one has not read them back yet (``purge_floor``)
        self._read_backs: deque[tuple[int, int]] = deque()
        #: the read-backs while applying messages up to this one are not known (a state loaded from a
        #: snapshot at it: ``loaded_at``; or forgotten past _READ_BACKS_KEPT)
        self._read_backs_unknown_to = 0
        self._spill_log = ThrottledWarning(log, every=10.0)
        self._lost_log = ThrottledWarning(log, every=10.0)
        #: per offload medium, its index over the same worker ids (the GPU's is ``self.index``)
        self.media: dict[str, BlockIndex] = {m: new_block_index() for m in OFFLOAD_MEDIA}
        #: pod -> [first, last] stream time (ns) of its messages applied by this replica (0: not known, as
        #: in benchmarks): what ``explain`` reports as "since" and "last event"
        self.activity: dict[str, list[int]] = {}
        #: workers that stored in an offload medium since they were last cleared whole: a GPU ``cleared``
        #: keeps their id, which the media's entries still name
        self._offloaded: set[int] = set()

    # -- stream messages ---------------------------------------------------------------------------
    def apply(self, msg: dict, stored_ns: int | None = None, stream_seq: int = 0, read_back: bool = False) -> None:
        """``stored_ns``: when the stream stored the message (None: not checked, as in benchmarks; early
        batches then wait only for the count bound). ``stream_seq``: its stream sequence (0: unknown;
        early messages past ``max_early`` then declare the gap lost instead of being spilled).
        ``read_back``: a message read back from the stream (``read_back_due``), applied to its worker
        alone: stream time does not move and nothing expires. Queries on other threads see it applied
        wholly or not at all."""
        with self.index.batch():
            self._apply(msg, stored_ns, stream_seq, read_back)

    def _apply(self, msg: dict, stored_ns: int | None, stream_seq: int = 0, read_back: bool = False) -> None:
        kind = msg.get("type")
        self._seq = stream_seq
        if read_back:
            self.stats.read_back += 1
        else:
            self._live_seq = stream_seq
        if stored_ns is not None:
            if kind in ("batch", "reset"):
                _check_plausible(msg, stored_ns)
            elif msg.get("gen") is not None:
                _check_mark(msg, stored_ns)
            if not read_back:
                self._now = stored_ns
                if self._waiting:
                    self._expire(stored_ns)
        if kind == "batch":
            self._on_batch(msg)
        elif kind == "reset":
            self._on_reset(msg)
        elif kind == "pod_removed":
            self._on_pod_removed(msg["pod"], _mark(msg))
        elif kind == "rank_removed":
            self._on_rank_removed(msg["pod"], msg["rank"], _mark(msg))
        else:
            raise ValueError(f"unknown L1 message type {kind!r}")

    def _on_batch(self, msg: dict) -> None:
        if "last_seq" in msg and (error := run_error(msg)):
            raise ValueError(f"malformed run of batches: {error}")
        key = (msg["pod"], msg["rank"])
        seen = self.activity.get(key[0])
        if seen is None:
            self.activity[key[0]] = [self._now, self._now]
        else:
            seen[1] = self._now
        gen, seq, part = msg["gen"], msg["seq"], msg.get("part", 0)
        cur = self.cursors.get(key)
        if cur is None and gen <= self._retired_before(key[0]):
            self.stats.stale += 1
            return
        if cur is None or gen > cur.gen:
            # First sight of this worker, or a newer generation whose reset has not arrived (yet): applied
            # from here, provisionally (journaled) until the reset says where the generation starts.
            if cur is not None:
                self._clear(key)
                self._waiting.pop(key, None)
            cur = self._set_cursor(key, _Cursor(gen=gen, next_seq=seq, next_part=part,
                                                journal=[] if self._now else None, journal_since=self._now))
        elif gen < cur.gen:
            self.stats.stale += 1
            return
        pos, want = (seq, part), (cur.next_seq, cur.next_part)
        skip = 0
        if pos < want:
            if cur.next_part or last_seq(msg) < cur.next_seq:
                if cur.journal is not None and pos < (cur.journal[0]["seq"], cur.journal[0].get("part", 0)):
                    self._journal(cur, msg)  # before where the provisional generation began: kept for its reset
                self.stats.duplicates += 1
                return
            skip = msg["ends"][cur.next_seq - seq - 1]  # a run overlapping what was applied: the rest of it
            pos = want
        if pos > want:
            if cur.next_seq == _DEAD:
                self.stats.stale += 1
                return
            if self._seq and len(cur.early) >= self.max_early and pos not in cur.early:
                self._spill(key, cur, pos, msg)
                return
            self._keep_early(key, cur, pos, msg)
            # without stream sequences nothing can be read back: past max_early the gap is lost. With them,
            # only a journal rebuilt at a late reset holds more (within max_journal): not a loss
            if len(cur.early) > self.max_early and not self._seq:
                self._lose_gap(key, cur)
            return
        self._journal(cur, msg)
        cur.advance(msg)  # first: a batch that cannot be applied whole must not hold up the ones after it
        self._apply_events(key, msg["events"][skip:] if skip else msg["events"], _batches(msg))
        if cur.early or cur.spilled:
            self._apply_early(key, cur)
        elif cur.early_since:  # the last one read back: caught up, a later gap waits from its own time
            cur.early_since = 0
            self._waiting.pop(key, None)

    def _spill(self, key: tuple[str, int], cur: _Cursor, pos: tuple[int, int], msg: dict) -> None:
        """``max_early`` messages of the worker are held: this one stays in the stream alone; the cursor
        keeps where to find it."""
        other = cur.spilled.get(pos)
        if other is None or last_seq(msg) > other[1]:  # of two from one seq, the one reaching further
            cur.spilled[pos] = (self._seq, last_seq(msg))
        self.stats.spilled += 1
        self._spill_log("%s rank %d: %d batches held waiting for seq %d; later ones (stream seq %d on) are read "
                        "back from the stream when their turn comes", key[0], key[1], len(cur.early), cur.next_seq,
                        self._seq)
        if key not in self._waiting:
            self._wait_from(key, cur, cur.early_since or self._now)

    @staticmethod
    def _spilled_next(cur: _Cursor) -> tuple[int, int] | None:
        """The position of the spilled message that goes on from the cursor (None: not spilled)."""
        pos = (cur.next_seq, cur.next_part)
        if pos in cur.spilled:
            return pos
        if not cur.next_part:
            for at, (_, last) in cur.spilled.items():  # a run that starts earlier goes on from here
                if at[0] < cur.next_seq <= last:
                    return at
        return None

    def read_back_due(self) -> tuple[tuple[str, int], int] | None:
        """A worker whose cursor reached a spilled message, and that message's stream sequence (None: no
        read-back due). The caller gets that stream message, says so (``read_back_taken``) and applies it
        (every slice of a run) with ``read_back=True``, or says it is gone (``read_back_gone``), then asks
        again until None: the cursor may reach the next one. Until then the entry stays: a read-back cut off
        while it waits for the stream (a consumer made again) is due again when the message comes again."""
        while self._read_back:
            key = next(iter(self._read_back))
            cur = self.cursors.get(key)
            if cur is not None and cur.next_seq != _DEAD and (pos := self._spilled_next(cur)) is not None:
                return key, cur.spilled[pos][0]
            del self._read_back[key]
        return None

    def read_back_taken(self, key: tuple[str, int], at: int, gone: bool = False) -> None:
        """The stream message ``at`` that ``read_back_due`` named for ``key`` is in hand: applied next (or
        ``gone``: no replica reads it back any more, nothing to keep for them)."""
        self._read_back.pop(key, None)
        if self._live_seq and at and not gone:
            self._read_backs.append((self._live_seq, at))
            if len(self._read_backs) > _READ_BACKS_KEPT:
                self._read_backs_unknown_to = max(self._read_backs_unknown_to, self._read_backs.popleft()[0])
        cur = self.cursors.get(key)
        if cur is not None:
            for pos in [p for p, (q, _) in cur.spilled.items() if q == at]:
                del cur.spilled[pos]

    def read_back_gone(self, key: tuple[str, int], at: int) -> None:
        """The spilled message ``read_back_due`` named for ``key`` is gone from the stream (retention): the
        worker goes on as after a lost gap, from the first early message left (if any; else it waits)."""
        self.read_back_taken(key, at, gone=True)
        cur = self.cursors.get(key)
        if cur is not None and cur.next_seq != _DEAD and (cur.early or cur.spilled):
            self._lose_gap(key, cur)

    def read_back_pending(self) -> bool:
        """A spilled message is to be read back before the next one is applied (no snapshot now)."""
        return bool(self._read_back)

    def loaded_at(self, stream_seq: int) -> None:
        """This state was loaded from a snapshot at ``stream_seq``: the read-backs before it are not known."""
        self._read_backs_unknown_to = stream_seq

    def purge_floor(self, keep_from: int) -> int:
        """How far the stream may be purged (0: no bound) by a writer that keeps its messages from
        ``keep_from`` on for replicas close behind it: not past a spilled message this replica still reads
        back, nor past one it read back while applying a message from ``keep_from`` on. A replica there
        has spilled it too and has yet to read it back: replicas spill and read back alike, as a function
        of the stream. A state that does not know its read-backs that far back (loaded from a snapshot
        after ``keep_from``) vouches for nothing: 1, nothing purged."""
        if keep_from <= self._read_backs_unknown_to:
            return 1
        while self._read_backs and self._read_backs[0][0] < keep_from:  # behind every replica that is kept
            self._read_backs.popleft()
        return min((q for q in (self.spill_floor(), *(at for _, at in self._read_backs)) if q), default=0)

    def spill_floor(self) -> int:
        """The lowest stream sequence of a spilled message (0: none): the stream must not be purged past it."""
        return min((q for c in self.cursors.values() for q, _ in c.spilled.values()), default=0)

    def _keep_early(self, key: tuple[str, int], cur: _Cursor, pos: tuple[int, int], msg: dict) -> None:
        other = cur.early.get(pos)
        if other is None or last_seq(msg) > last_seq(other):  # of two from one seq, the one reaching further
            cur.early[pos] = msg
        self.stats.early += 1
        if key not in self._waiting:
            self._wait_from(key, cur, cur.early_since or self._now)

    def _wait_from(self, key: tuple[str, int], cur: _Cursor, since: int) -> None:
        """Held batches of ``key`` wait from stream time ``since`` (not timed where times are unknown)."""
        cur.early_since = since
        if since:
            self._waiting[key] = since

    def _journal(self, cur: _Cursor, msg: dict) -> None:
        if cur.journal is not None:
            if len(cur.journal) >= self.max_journal or self._now - cur.journal_since > EARLY_TIMEOUT_NS:
                cur.journal = None  # no reset is coming (it was purged), or not soon: stop keeping them
            else:
                cur.journal.append(msg)

    def _lose_gap(self, key: tuple[str, int], cur: _Cursor) -> None:
        """The missing batches are not coming: forget the worker and go on from the first early one (held
        or spilled)."""
        first = min([*cur.early, *cur.spilled])
        self.stats.lost_gaps += 1
        self._lost_log("%s rank %d: batches %d..%d never arrived (%d later ones early): the worker starts again from "
                       "seq %d", key[0], key[1], cur.next_seq, first[0] - 1, len(cur.early) + len(cur.spilled),
                       first[0])
        self._clear(key)
        cur.next_seq, cur.next_part = first
        cur.journal = None
        self._apply_early(key, cur)
        if cur.early or cur.spilled:  # another gap further on: it gets its own time
            self._wait_from(key, cur, self._now)

    def _expire(self, now: int) -> None:
        """Held batches that waited longer than EARLY_TIMEOUT_NS (stream time) for a missing one."""
        if min(self._waiting.values()) > now - EARLY_TIMEOUT_NS:
            return
        for key in [k for k, since in self._waiting.items() if since <= now - EARLY_TIMEOUT_NS]:
            cur = self.cursors.get(key)
            if cur is not None and (cur.early or cur.spilled) and cur.next_seq != _DEAD:
                self._lose_gap(key, cur)
            else:
                self._waiting.pop(key, None)

    def _apply_early(self, key: tuple[str, int], cur: _Cursor) -> None:
        while (nxt := cur.take_early()) is not None:
            msg, skip = nxt
            self._journal(cur, msg)
            cur.advance(msg)
            self._apply_events(key, msg["events"][skip:] if skip else msg["events"], _batches(msg))
        early, spilled, at = cur.early, cur.spilled, (cur.next_seq, cur.next_part)
        for pos in [pos for pos, msg in early.items() if (last_seq(msg), pos[1]) < at]:
            del early[pos]
        if spilled:
            for pos in [pos for pos, (_, last) in spilled.items() if (last, pos[1]) < at]:
                del spilled[pos]
            if self._spilled_next(cur) is not None:
                self._read_back[key] = None  # read back before the next message is applied
        if not early and not spilled:
            cur.early_since = 0
            self._waiting.pop(key, None)

    def _on_reset(self, msg: dict) -> None:
        key = (msg["pod"], msg["rank"])
        gen = msg["gen"]
        cur = self.cursors.get(key)
        if (gen < cur.gen or (gen == cur.gen and cur.reset_seen)) if cur is not None else \
                gen <= self._retired_before(key[0]):
            self.stats.stale += 1
            return
        self.stats.resets += 1
        if cur is not None and gen == cur.gen:
            cur.reset_seen = True  # its batches already started this generation
            journal, cur.journal = cur.journal, None
            start = msg["next_seq"]
            if journal and start < journal[0]["seq"]:  # it starts before what was applied: rebuild from there
                self._clear(key)
                for m in journal:  # of two from one seq (a run and a batch), the one reaching further
                    pos = (m["seq"], m.get("part", 0))
                    other = cur.early.get(pos)
                    if other is None or last_seq(m) > last_seq(other):
                        cur.early[pos] = m
                cur.next_seq, cur.next_part = start, 0
                self._wait_from(key, cur, cur.early_since or self._now)
                self._apply_early(key, cur)
            return
        self._clear(key)
        self._waiting.pop(key, None)
        self._set_cursor(key, _Cursor(gen=gen, next_seq=msg["next_seq"], reset_seen=True))

    def _on_pod_removed(self, pod: str, before: int | None = None) -> None:
        """Every rank of the pod goes, and its generation is retired; with ``before`` (the removal's mark),
        only a generation older than it: a newer one (the pod back, its messages stored before this one's
        by a retry) stays, and an older one whose messages the stream stores after this one (a rank not seen
        yet among them) is stale."""
        kept = False
        for rank in sorted(set(self.workers.pod_workers(pod)) | self._pod_ranks.get(pod, set())):
            stays = not self._remove((pod, rank), before)
            kept |= stays and rank != _POD
        if before is not None and (pod, _POD) not in self.cursors:
            self._set_cursor((pod, _POD), _Cursor(gen=before - 1, next_seq=_DEAD))
        if not kept:
            self.activity.pop(pod, None)

    def _on_rank_removed(self, pod: str, rank: int, before: int | None = None) -> None:
        """One rank left, the pod stays: that rank's blocks go and its generation is retired (``before``: as
        pod_removed's)."""
        if type(rank) is not int:
            raise ValueError(f"rank_removed: rank {rank!r} is not an int")
        self._remove((pod, rank), before)

    def _remove(self, key: tuple[str, int], before: int | None) -> bool:
        """The worker's blocks go and its generation is retired, unless it is one from ``before`` on; False
        where it stays."""
        cur = self.cursors.get(key)
        if cur is not None and before is not None and cur.gen >= before:
            return False
        self._clear(key)
        if cur is not None:
            self._retire(key, cur, before)
        elif before is not None:  # none of it seen yet: what comes of its older generations is stale
            self._set_cursor(key, _Cursor(gen=before - 1, next_seq=_DEAD))
        return True

    def _retired_before(self, pod: str) -> int:
        """The generations of a worker first seen now that the pod's last removal retired (those up to it)."""
        mark = self.cursors.get((pod, _POD))
        return -1 if mark is None else mark.gen

    def _retire(self, key: tuple[str, int], cur: _Cursor, before: int | None = None) -> None:
        """Later batches of the worker's generation are stale (a new generation starts it again), and with
        ``before`` those of any generation older than it (started before the removal, stored after it)."""
        cur.next_seq, cur.next_part = _DEAD, 0
        if before is not None:
            cur.gen = max(cur.gen, before - 1)
        cur.early.clear()
        cur.spilled.clear()
        cur.journal, cur.early_since = None, 0
        self._waiting.pop(key, None)

    # -- block events ------------------------------------------------------------------------------
    def _apply_events(self, key: tuple[str, int], events: list[dict], batches: int = 1) -> None:
        """Consecutive GPU stores of group 0 are stored in one call (a run of one-block batches is mostly
        that): storing is per hash and in order, so it is the same as one call per event. The events are
        checked first: a batch is applied whole or refused whole (MalformedMessage, TooManyWorkers)."""
        stats = self.stats
        stats.batches += batches
        try:
            hashes_of = checked_events(events)
        except MalformedMessage:
            stats.malformed_events += 1
            raise
        if self.workers.get(*key) is None and not self.workers.room() and any(h for h in hashes_of):
            stats.malformed_events += 1
            raise TooManyWorkers(f"{key[0]} rank {key[1]}: every worker id of L1 is taken; its batch is refused")
        wid = None
        plain = array("Q")  # hashes of consecutive stores of group 0, not yet stored
        counted = 0
        for ev, hashes in zip(events, hashes_of):
            medium = ev.get("medium")
            if medium is not None and medium != "GPU":
                counted += self._apply_offload(key, medium, ev, hashes)
                continue
            kind = ev["kind"]
            group = ev.get("group_idx")
            if kind == "stored" and not group:
                plain += hashes
                counted += len(hashes)
                continue
            if plain:
                wid = self._store(key, wid, plain, None)
                plain = array("Q")
            if kind == "stored":
                wid = self._store(key, wid, hashes, group)
                counted += len(hashes)
            elif kind == "removed":
                w = self.workers.get(*key)
                if w is not None:
                    self.index.remove(w, hashes, group)
                counted += len(hashes)
            else:  # cleared
                w = self.workers.get(*key)
                if w is not None and w in self._offloaded:
                    self.index.clear(w)  # the worker's offloaded blocks stay, under its id
                else:
                    self._clear(key)
                wid = None
                counted += 1
        if plain:
            self._store(key, wid, plain, None)
        stats.block_events += counted

    def _apply_offload(self, key: tuple[str, int], medium: str, ev: dict, hashes: array | None) -> int:
        """One event of an offload medium (the GPU's order does not matter to it: another index), checked
        already. Returns the block events it counts (0: an unknown medium, dropped)."""
        index = self.media.get(medium)
        group = ev.get("group_idx")
        if index is None:
            self.stats.ignored_medium += 1
            return 0
        kind = ev["kind"]
        if kind == "stored":
            wid = self.workers.intern(*key)
            self._offloaded.add(wid)
            index.store(wid, hashes, group)
            return len(hashes)
        wid = self.workers.get(*key)
        if kind == "removed":
            if wid is not None:
                index.remove(wid, hashes, group)
            return len(hashes)
        if kind == "cleared" and wid is not None:
            index.clear(wid)
        return 1

    def _store(self, key: tuple[str, int], wid: int | None, hashes: array, group: int | None) -> int:
        if wid is None:
            wid = self.workers.intern(*key)
        self.index.store(wid, hashes, group)
        return wid

    def indexes(self) -> list[BlockIndex]:
        return [self.index, *self.media.values()]

    def _clear(self, key: tuple[str, int]) -> None:
        """Every medium of the worker, and its id goes back (its generation moves on in every index)."""
        wid = self.workers.get(*key)
        if wid is not None:
            self._offloaded.discard(wid)
            self.release(*key)

    def _set_cursor(self, key: tuple[str, int], cur: _Cursor) -> _Cursor:
        self.cursors[key] = cur
        self._pod_ranks.setdefault(key[0], set()).add(key[1])
        return cur

    # -- snapshots ---------------------------------------------------------------------------------
    def cursor_rows(self) -> list[list]:
        """Every worker's position, as snapshots store it (indexer/snapshot.py)."""
        return [[pod, rank, c.gen, c.next_seq, c.reset_seen, list(c.early.values()), c.next_part, c.journal,
                 c.early_since, c.journal_since, [[*pos, *at] for pos, at in c.spilled.items()]]
                for (pod, rank), c in self.cursors.items()]

    def restore_cursor(self, pod: str, rank: int, gen: int, next_seq: int, reset_seen: bool, early: list[dict],
                       next_part: int = 0, journal: list[dict] | None = None, early_since: int = 0,
                       journal_since: int = 0, spilled: list[list[int]] = ()) -> None:
        """A position from ``cursor_rows`` (the last fields are absent from older snapshots)."""
        cur = self._set_cursor((pod, rank), _Cursor(gen=gen, next_seq=next_seq, reset_seen=reset_seen,
                                                    early={(m["seq"], m.get("part", 0)): m for m in early},
                                                    next_part=next_part, journal=journal, journal_since=journal_since,
                                                    spilled={(q, p): (sq, last) for q, p, sq, last in spilled}))
        if cur.early or cur.spilled:
            self._wait_from((pod, rank), cur, early_since)

    def adopt_offloaded(self, wids) -> None:
        """Workers a loaded snapshot shows holding offloaded blocks."""
        self._offloaded.update(wids)

    # -- queries -----------------------------------------------------------------------------------
    def knows(self, pod: str) -> bool:
        """Events were seen for the pod and it was not removed, though it may hold nothing now (after
        AllBlocksCleared or a reset). Looks at the pod's own cursors (a scan of every cursor cost 0.3 ms a
        query at 2,000 workers, while a pod restarted). A copy of its ranks first (one C call): a query
        thread may ask while the event loop applies a message."""
        cursors = self.cursors
        for rank in list(self._pod_ranks.get(pod, ())):
            cur = cursors.get((pod, rank))
            if cur is not None and cur.next_seq != _DEAD:
                return True
        return False


def _check_plausible(msg: dict, stored_ns: int) -> None:
    gen = msg["gen"]
    if gen > stored_ns + GEN_MAX_AHEAD_NS:
        raise ImplausibleMessage(f"generation {gen} is {(gen - stored_ns) / 1e9:.0f}s ahead of the time the stream "
                                 f"stored the message ({msg['pod']} rank {msg['rank']}): refused")
    last = msg.get("last_seq")
    for seq in (msg.get("seq", msg.get("next_seq")), 0 if last is None else last):
        if not isinstance(seq, int) or not 0 <= seq <= MAX_SEQ:
            raise ImplausibleMessage(f"seq {seq!r} is not a vLLM seq ({msg['pod']} rank {msg['rank']}): refused")


def _mark(msg: dict) -> int | None:
    """A removal's mark (None: an older bridge's, retiring every generation)."""
    gen = msg.get("gen")
    if gen is not None and (type(gen) is not int or gen < 0):
        raise ValueError(f"{msg.get('type')}: gen {gen!r} is not a generation")
    return gen


def _check_mark(msg: dict, stored_ns: int) -> None:
    """A removal's mark far ahead of the time the stream stored it would retire every later generation of
    the pod: refused, as a batch's generation would be."""
    gen = msg["gen"]
    if type(gen) is int and gen > stored_ns + GEN_MAX_AHEAD_NS:
        raise ImplausibleMessage(f"{msg.get('type')} mark {gen} is {(gen - stored_ns) / 1e9:.0f}s ahead of the time "
                                 f"the stream stored it ({msg.get('pod')}): refused")


def _batches(msg: dict) -> int:
    """vLLM batches a message completes (a part of a batch counts as one, as before)."""
    return last_seq(msg) - msg["seq"] + 1
