"""Where each (pod, rank) stands in the L1 stream, kept where the snapshot writer's purges cannot reach.

A restarted, killed or standby bridge continues an engine's generation from the last batch the stream
stored for it. The stream's last message on the worker's subject says so while it exists, but the
snapshot writer purges the stream behind each snapshot (keeping the newest ``purgeKeep`` messages of
all subjects together), so an engine that went idle loses its last message long before its blocks
leave its cache. Without a resume point the next bridge started a new generation, whose reset wiped
what only the purged history held (vLLM's replay buffer keeps 10,000 batches; a system prompt cached
hours ago is far older).

So the bridge also keeps, per pod, a record in the records bucket (``infra.streams.records_bucket``,
``snapshot.metaBucket``; key ``bridge.resume.<pod>``): per rank the generation, the last vLLM seq the
stream stored whole (acked, and every message before it of that worker acked too: a resume point never
passes a hole), the engine's epoch, vLLM's timestamp of that batch and the stream sequence that stored it.
A worker's first position is written at once, later ones at most every ``interval`` seconds
(``ingest.l1.resumeInterval``), only for pods whose position moved, or at once where the worker has
run ``RECORD_LAG_MAX`` batches past its last write (a burst: the record must stay within what the
engine's buffer reaches back to).
A bridge resumes from the record:
the stream's last message may lie past one that never made it (stored late, or lost with a killed
bridge), the record never does; what followed it is published again from the engine's buffer and
deduplicated. Where the stream holds a generation newer than the record (younger than a record write),
a new generation starts, which loses nothing so young; where the worker has no record (the first
start after an upgrade, or a bridge killed before its first write), the stream's last message is the
position, and the engine's buffer up to it is published again (bridge/l1_sequencer.py): a message
before it may never have been stored, and the acks of the republished ones record the position (an
idle engine's would otherwise never be written, and the next bridge after a purge would start it anew).
A record of another incarnation of the stream (one recreated since) is ignored. A pod's ``pod_removed``
(or a rank's ``rank_removed``) turns its record into the removal's mark, not a deletion: the generations
up to it are retired, and a later bridge resumes none of them, also where the stream's last message on
the worker's subject is one of theirs stored after the removal (a retry) and the removal itself was
purged since (a snapshot), which the stream alone can no longer tell.

Several bridges write a pod's record over time (sharded ones as its shard moves, leaders one after the
other), and one that lost the pod may still get acks of its batches in flight, and write. A record is
therefore written on the revision its writer last read or wrote (``_write_pod``): a write over another
bridge's is refused, and the writer merges that record in first.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgpack
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from cache_indexer.infra.streams import RecordsKv, subject_token
from cache_indexer.infra.tasks import cancel_and_wait
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.config import L1IngestConfig

log = logging.getLogger(__name__)

KEY_PREFIX = "bridge.resume."
#: How often moved positions are written: ``ingest.l1.resumeInterval``'s default. Every write is a KV put
#: (a stored message and its ack) for each pod that moved, about one per pod per interval on a busy
#: fleet: at 1 s they were a third as many messages as the events themselves on a trace of 8 engines.
#: A bridge killed in between leaves a record older than its last acks; its successor resumes from that
#: record and publishes what followed again from the engine's buffer (deduplicated by message id, then
#: by the indexers), so an interval of seconds loses nothing while the buffer (vLLM: 10,000 batches)
#: lasts longer than that.
WRITE_EVERY = L1IngestConfig.model_fields["resumeInterval"].default
#: How many batches a worker's position may run past its last write before it is written at once, not at
#: the interval. A bridge killed before the write is followed by one that resumes from the record, and the
#: batches since must still be in the engine's replay buffer (vLLM's keeps 10,000): an engine that
#: published more than its buffer within the interval and then went idle was reset at the next bridge,
#: its history lost, once the snapshot writer had purged the burst's messages. A busy worker's writes are
#: then at most one per this many batches (1.6% of its messages; a trace's engines reach the interval
#: first). A write at once writes only the pods due at once; the others that moved wait for the interval
#: (written with it, every pod's record went at the busiest pod's pace: one pod at 250 batches a second
#: beside 99 at 2.5 made 3,823 puts in 20 s, now 377; on the trace's even fleet both make the same).
RECORD_LAG_MAX = 64
#: After a failed write, when the write loop tries again (and the earliest it writes at once again: a
#: refusing NATS would otherwise get a put per ack).
RETRY_AFTER = 1.0
#: How many times a write of a record another bridge keeps writing is read, merged and tried again before
#: it waits for the write loop's next round.
MERGE_TRIES = 3


@dataclass(frozen=True, slots=True)
class Position:
    """The last vLLM batch of a worker that the stream holds whole."""
    gen: int
    seq: int  # vLLM's seq of that batch (next_seq - 1 after a reset)
    epoch: str  # the engine's epoch when it was published ("-": none)
    ts: float | None  # vLLM's timestamp of that batch (None: not known; no incarnation check then)
    stream_seq: int  # the stream sequence that stored it: which of two positions is newer
    #: False: taken from the stream's last message, not from a record: the previous bridge's publishes in
    #: flight may have been stored out of order, so a message before it may be missing (the sequencer
    #: publishes the engine's buffer up to it again, and those acks record it)
    tail_checked: bool = True

    def after(self, other: "Position") -> bool:
        """Whether this position is past ``other``: by generation (a newer one is a later wall clock), then
        seq; not by stream sequence alone, as acks come out of order (a retry) and a batch of an older
        generation may be stored after a newer one's (another bridge's retry)."""
        return (self.gen, self.seq, self.stream_seq) > (other.gen, other.seq, other.stream_seq)


def record_key(pod: str) -> str:
    return KEY_PREFIX + subject_token(pod)


class ResumePoints:
    def __init__(self, js, bucket: str, replicas: int = 1, interval: float = WRITE_EVERY) -> None:
        self._store = RecordsKv(js, bucket, replicas)
        self.interval = interval
        #: the stream incarnation (streams.stream_id) the positions refer to
        self.stream_id = ""
        self._positions: dict[str, dict[int, Position]] = {}
        self._dirty: set[str] = set()
        #: pods whose record was deleted -> the newest generation then: later acks of those are ignored
        self._forgotten: dict[str, int] = {}
        #: likewise per (pod, rank) removed alone (bridge: a rank unregistered, dpRanks shrunk)
        self._forgotten_ranks: dict[str, dict[int, int]] = {}
        self._task: asyncio.Task | None = None
        #: (generation, seq) of each worker's last position written: a worker's first position is written at
        #: once (a bridge killed within the interval would otherwise leave it with no record at all, and a
        #: purge then takes the stream's message too), and so is one ``RECORD_LAG_MAX`` past its last write
        #: or of another generation; others at most every ``interval``
        self._written: dict[tuple[str, int], tuple[int, int]] = {}
        self._due = asyncio.Event()
        #: pods with a position to write at once (``_due``): the write loop writes those alone before the interval
        self._urgent: set[str] = set()
        #: a position moved (set with every pod marked dirty): the write loop sleeps on it while there is nothing
        #: to write, instead of waking every ``interval`` for nothing
        self._moved = asyncio.Event()
        #: a put of the write loop's last write failed: it waits RETRY_AFTER, then tries again
        self._failed = False
        #: the revision of each pod's record as this bridge last wrote or read it (``_write_pod``)
        self._revision: dict[str, int] = {}
        self._warn = ThrottledWarning(log)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._write_loop(), name="bridge-resume-points")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None
        await self.write()

    def update(self, pod: str, rank: int, pos: Position) -> None:
        """A position the stream acknowledged (called from the publisher's ack handler)."""
        if pos.gen <= self.retired(pod, rank):
            return  # a late ack of a pod (or rank) since removed
        ranks = self._positions.setdefault(pod, {})
        old = ranks.get(rank)
        # by generation and seq, not by stream sequence: acks come out of order (a retry), and the prefix a
        # late ack completes ends in a message the stream stored before the one that moved it last (it stuck
        # at a generation's reset, whose missing timestamp then made the next bridge start a new one)
        if old is None or pos.after(old):
            ranks[rank] = pos
            self._dirty.add(pod)
            self._moved.set()
            written = self._written.get((pod, rank))
            if written is None or written[0] != pos.gen or pos.seq - written[1] >= RECORD_LAG_MAX:
                self._urgent.add(pod)
                self._due.set()

    def generations(self, pod: str, rank: int | None = None) -> list[int]:
        """The generations this bridge knows a position of for the pod (or one rank of it)."""
        return [p.gen for r, p in self._positions.get(pod, {}).items() if rank in (None, r)]

    async def load(self, pod: str) -> dict[int, Position] | None:
        """The positions last recorded for the pod's ranks on this stream (a rank without one is absent);
        None when the pod has no record here, or it cannot be read."""
        try:
            record = await self._read(await self._store(), pod)
        except Exception as exc:  # unreadable: the stream's last message alone decides, as before records
            self._warn("resume record of %s unreadable (%s)", pod, exc)
            return None
        return self._take(pod, record)

    async def _read(self, kv, pod: str) -> dict | None:
        """The pod's record as stored (None: none), its revision noted: this bridge's next write of it is
        made on that revision."""
        try:
            entry = await kv.get(record_key(pod))
        except (KeyNotFoundError, NotFoundError):
            self._revision.pop(pod, None)
            return None
        self._revision[pod] = entry.revision
        return msgpack.unpackb(entry.value, strict_map_key=False) if entry.value else {}

    def _take(self, pod: str, record: dict | None) -> dict[int, Position] | None:
        """What a record holds becomes this bridge's own: its removal marks, and its positions on this
        stream (returned)."""
        if not isinstance(record, dict) or record.get("pod") != pod:
            return None
        self._adopt_retired(pod, record)
        if record.get("stream") != self.stream_id:
            log.info("resume record of %s is of another incarnation of the stream (%s, not %s): not used", pod,
                     record.get("stream"), self.stream_id)
            return None
        positions = {}
        for rank, row in (record.get("ranks") or {}).items():
            try:
                gen, seq, epoch, ts, stream_seq = row
                positions[rank] = Position(int(gen), int(seq), str(epoch), float(ts) if ts is not None else None,
                                           int(stream_seq))
            except (TypeError, ValueError):
                continue
        self._adopt(pod, positions)
        return positions

    def _adopt_retired(self, pod: str, record: dict) -> None:
        """The removal marks a record carries (of any incarnation of the stream: a generation is retired
        whatever stream its messages are on) become this bridge's own."""
        try:
            retired = int(record.get("retired", -1))
            ranks = {int(rank): int(gen) for rank, gen in (record.get("retiredRanks") or {}).items()}
        except (TypeError, ValueError, AttributeError):
            return
        if retired > self._forgotten.get(pod, -1):
            self._forgotten[pod] = retired
        for rank, gen in ranks.items():
            mine = self._forgotten_ranks.setdefault(pod, {})
            if gen > mine.get(rank, -1):
                mine[rank] = gen
        known = self._positions.get(pod, {})
        for rank in [r for r, pos in known.items() if pos.gen <= self.retired(pod, r)]:
            del known[rank]  # another bridge removed it since this one saw it acked

    def retired(self, pod: str, rank: int) -> int:
        """The newest generation of the worker a removal retired (-1: none known): never resumed."""
        return max(self._forgotten.get(pod, -1), self._forgotten_ranks.get(pod, {}).get(rank, -1))

    def stream_lost(self) -> None:
        """The positions known name a stream lost since: none is resumed or written (records of the lost
        stream name it, and are ignored)."""
        self._positions.clear()

    def own(self, pod: str, rank: int) -> Position | None:
        """The last position of the worker this bridge saw acked (or adopted from the record), written or not."""
        return self._positions.get(pod, {}).get(rank)

    def _adopt(self, pod: str, positions: dict[int, Position]) -> None:
        """The recorded ranks become this bridge's own: the record is rewritten whole from what this process
        knows, and a rank that stays idle (no ack since the start) would otherwise drop out of it at the
        next write, and with a purge its history (the record then holds only the busy ranks)."""
        forgotten = self._forgotten.get(pod, -1)
        ranks = self._positions.setdefault(pod, {})
        for rank, pos in positions.items():
            if pos.gen <= max(forgotten, self._forgotten_ranks.get(pod, {}).get(rank, -1)):
                continue
            old = ranks.get(rank)
            if old is None or pos.after(old):  # (another bridge's record merged in: what it names may be older)
                ranks[rank] = pos

    async def forget_rank(self, pod: str, rank: int, before: int = -1) -> None:
        """One rank of the pod left: it goes from the record (rewritten at once), and acks still in flight
        for it are ignored: those of a generation before ``before`` (the removal's mark) too, also one not
        acked once yet (the record would otherwise take it back, and the next bridge resume it)."""
        ranks = self._positions.get(pod, {})
        pos = ranks.pop(rank, None)
        self._written.pop((pod, rank), None)
        gen = max(pos.gen if pos is not None else -1, before - 1)
        mine = self._forgotten_ranks.setdefault(pod, {})
        mine[rank] = max(gen, mine.get(rank, -1))
        if not ranks:
            self._positions.pop(pod, None)
        self._dirty.add(pod)
        await self.write()

    async def forget(self, pod: str, before: int = -1) -> None:
        """The pod left: its record keeps only the removal's mark, and acks still in flight for it are
        ignored (as ``forget_rank``)."""
        ranks = self._positions.pop(pod, {})
        self._written = {key: at for key, at in self._written.items() if key[0] != pod}
        self._forgotten[pod] = max([p.gen for p in ranks.values()] + [self._forgotten.get(pod, -1), before - 1])
        self._dirty.add(pod)
        await self.write()

    async def write(self, urgent_only: bool = False) -> None:
        """Write the records of the pods whose position moved (``urgent_only``: of those due at once); what
        fails stays to be written next time. The pods' records are written at once, not one after the other
        (each a round trip to the server, a wake-up of the bridge each where batches come alone)."""
        if urgent_only:
            pods = self._dirty & self._urgent
            self._dirty -= pods
        else:
            pods, self._dirty = self._dirty, set()
        self._urgent -= pods
        if not pods:
            return
        try:
            await self._write(pods)
        except asyncio.CancelledError:  # stop() cancelled the loop mid-write: its own write takes these pods
            self._again(*pods)
            raise

    async def _write(self, pods: set[str]) -> None:
        try:
            kv = await self._store()
        except Exception as exc:  # the bucket did not open (NATS away)
            self._retry(*pods)
            self._warn("resume records not written (%s)", exc)
            return
        writes = [self._write_pod(kv, pod) for pod in pods]
        if len(writes) == 1:
            await writes[0]
        elif writes:
            await asyncio.gather(*writes)

    def _record(self, pod: str) -> tuple[bytes, dict[int, Position]] | None:
        """The pod's record as this bridge knows it (None: nothing to write), and the ranks it names."""
        ranks = {rank: p for rank, p in (self._positions.get(pod) or {}).items() if p.gen > self.retired(pod, rank)}
        record = {"pod": pod, "stream": self.stream_id, "ranks": {
            rank: [p.gen, p.seq, p.epoch, p.ts, p.stream_seq] for rank, p in ranks.items()}}
        if pod in self._forgotten:
            record["retired"] = self._forgotten[pod]
        if self._forgotten_ranks.get(pod):
            record["retiredRanks"] = dict(self._forgotten_ranks[pod])
        if not ranks and len(record) == 3:
            return None
        return msgpack.packb(record), ranks

    async def _write_pod(self, kv, pod: str) -> None:
        """The pod's record written on the revision this bridge last wrote or read. Another bridge may have
        written it since: one the pod's shard moved to, or the next leader, while acks of batches in flight
        still reach this one. Written over, its removal marks and newer positions would be lost, and a
        retired generation resumed from the record (the chaos soak, sharded, CHAOS_SEED=421964534). So a
        write on an older revision is refused; the record is read, what it holds merged in (marks and
        positions only move forwards: ``_take``), and written again."""
        for _ in range(MERGE_TRIES):
            built = self._record(pod)
            if built is None:
                return
            value, ranks = built
            # counted as written from now: the acks that come during the write wait for the next RECORD_LAG_MAX
            self._written.update(((pod, r), (p.gen, p.seq)) for r, p in ranks.items())
            try:
                revision = self._revision.get(pod)
                self._revision[pod] = await (kv.create(record_key(pod), value) if revision is None else
                                             kv.update(record_key(pod), value, last=revision))
                return
            except KeyWrongLastSequenceError:
                self._drop_written(pod, ranks)
                try:
                    record = await self._read(kv, pod)
                except Exception as exc:
                    self._not_written(pod, exc)
                    return
                self._take(pod, record)
                theirs = record.get("stream") if isinstance(record, dict) else None
                if isinstance(theirs, str) and self.stream_id and theirs > self.stream_id:
                    # written on a newer incarnation of the stream (recreated since): what this bridge knows
                    # of the pod's positions is of the old one; the record stays as the newer writer left it
                    log.info("resume record of %s is of a newer incarnation of the stream (%s, not %s): "
                             "not written over", pod, theirs, self.stream_id)
                    self._positions.pop(pod, None)
                    return
            except Exception as exc:
                # (what the bucket holds is unknown now, even which revisions it numbers: one recreated counts
                # from 1 again, and a write on a revision remembered from before could land blind)
                self._revision.pop(pod, None)
                self._drop_written(pod, ranks)
                self._not_written(pod, exc)
                return
        self._not_written(pod, f"written by another bridge {MERGE_TRIES} times while this one merged it")

    def _drop_written(self, pod: str, ranks: dict[int, Position]) -> None:
        for rank in ranks:  # not written after all: the next ack asks for a write at once
            self._written.pop((pod, rank), None)

    def _not_written(self, pod: str, why) -> None:
        self._retry(pod)
        self._warn("resume record of %s not written (%s)", pod, why)

    def _retry(self, *pods: str) -> None:
        """Records NATS did not take: tried again after RETRY_AFTER, not only at the next ack (an idle
        worker has none) or the interval."""
        self._failed = True
        self._urgent.update(pods)
        self._due.set()
        self._again(*pods)

    def _again(self, *pods: str) -> None:
        """Records not written: tried again by the write loop (woken, if it sleeps for want of any)."""
        self._dirty.update(pods)
        self._moved.set()

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            try:
                if not self._dirty:  # nothing to write: asleep until a position moves (an idle bridge stays so)
                    self._moved.clear()
                    await self._moved.wait()
                wait = last + self.interval - loop.time()
                if wait > 0 and not self._due.is_set():  # a first position, or one far ahead: at once
                    try:
                        await asyncio.wait_for(self._due.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                self._due.clear()
                interval = loop.time() >= last + self.interval
                if interval:
                    last = loop.time()
                self._failed = False
                await self.write(urgent_only=not interval)
                if self._failed:  # NATS refused: no write at once for a while (the interval's still comes)
                    await asyncio.sleep(min(RETRY_AFTER, self.interval))
            except asyncio.CancelledError:
                raise
            except Exception:  # never the end of the loop: the records would silently stop moving
                log.exception("writing resume records failed")
                await asyncio.sleep(self.interval)
