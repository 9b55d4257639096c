"""Model-based tests of the L1 sequencing (issue 24): the bridge's sequencer and the indexer's cursor,
driven through arbitrary interleavings against a reference model of what the engines hold.

The product's own decision code runs: bridge/l1_sequencer.py, bridge/l1_publisher.py with its resume
points (bridge/resume_points.py), indexer/l1_state.py and the snapshot encoding. Only the I/O around them
is modelled: JetStream (stored in order, ``Nats-Msg-Id`` deduplicated, purged behind snapshots), the
bridge's publisher (a message stays in flight until the model stores it, in any order; a crash loses what
is in flight), the KV bucket, and vLLM engines (seq from 0, a replay buffer of bounded size, a restart
empties both, answers cut short as a ROUTER past its high-water mark cuts them); two pods, the second
with two DP ranks. Steps: engines publish (stores of new chains, evictions, AllBlocksCleared; live or
lost on the way; into the buffer alone while no bridge subscribes), engines restart, in-flight messages
are stored late, out of order, or again past the duplicate window, the bridge is killed (in-flight
messages and unwritten resume records lost) or stopped gracefully and replaced, resume records are
written, snapshots are taken and the stream purged behind them, the indexer restarts from the snapshot,
the stream is deleted and created again by another process (what it held is lost; the bridge publishes
to the new one until it notices, and starts every subscription over then), time passes; and discovery (issue 36): a pod leaves (its subscribers stop) and comes back within
``removalGrace`` (a new subscription resumes from the record or the stream) or after it (``pod_removed``
first, maybe still in flight when it is back: a new generation), one DP rank is unlisted
(``rank_removed``) and listed again (a new generation), and a new subscription meets its engine quiet
with history in its buffer (first contact), with a live batch already waiting, or with one that raced the
catch-up. Bridges are replaced around all of it: a pod away is inherited as leaving, a ``pod_removed``
lost in flight is published again when the new grace ends.

At every quiet point (everything in flight stored, everything applied): with replay buffers larger than
the run, the index equals what each subscribed engine holds, and no generation was started but for an
engine restart, a first subscription, or one after a removal or where nothing says where the engine
stands; with small buffers (history truly lost), the index never holds a block the engine does not
(ratios may be low, never too high). A pod away within its grace holds a state its engine went through
(lossy: only blocks it held once); a pod or rank removed holds nothing.

The window left open, which the model steers around (where it says; docs/operations.md, recovery, lists it): (D) a pod
away within its grace whose messages were lost with a killed bridge after a later one was stored (the
indexers declare the hole lost after EARLY_TIMEOUT_NS and clear the worker; back, the pod resumes that
generation and what the clear took is not published again). A removal lost with a killed bridge (C) is
published again by the next one from the targets record (bridge/service.py; tests/test_l1_end_to_end.py),
which the model takes as the killed bridge's unstored removals (``L1Publisher.unstored_removals``): a pod's
is inherited as leaving (removed when the new grace ends), a rank's is removed again once its pod is
listed; a rank_removed in flight, or a removal being published again after a retired message stored late
(E, F), is stored before the kill.

A failure prints its steps and a ``@reproduce_failure`` blob that replays it exactly; each run prints its
seed, and ``SEQUENCING_SEED=N`` replays a whole run.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import time
from collections import Counter, deque
from types import SimpleNamespace

import msgpack
from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.l1_publisher import L1Publisher
from cache_indexer.bridge.l1_sequencer import L1Sequencer, Replayed
from cache_indexer.bridge.receive_budget import ReceiveBudget
from cache_indexer.bridge.resume_points import KEY_PREFIX, ResumePoints, record_key
from cache_indexer.infra.streams import l1_lifecycle_subject, l1_subject
from cache_indexer.infra.metrics import Metrics
from cache_indexer.simulate.vllm_engine import batch_payload, cleared, removed, stored
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.snapshot import decode_l1, encode_l1

STREAM, PREFIX = "KV_L1", "kvcache.l1"
PODS = ["10.0.0.1", "10.0.0.2"]
#: the engines: one DP rank each, but the second pod has two
WORKERS = [("10.0.0.1", 0), ("10.0.0.2", 0), ("10.0.0.2", 1)]


class ModelStream:
    """JetStream as the bridge and the indexers use it."""

    def __init__(self) -> None:
        self.incarnation = 0
        self.recreate()

    def recreate(self) -> None:
        """The stream deleted and created again (another incarnation, streams.stream_id): nothing of it left."""
        self.incarnation += 1
        self.id = f"s{self.incarnation:04d}"
        self.msgs: dict[int, SimpleNamespace] = {}
        self.last_seq = 0
        self.first_seq = 1
        self.ids: dict[str, int] = {}  # Nats-Msg-Id -> stream seq, within the duplicate window
        #: per worker's subject, the newest generation ever stored on it and the last one (a purge keeps
        #: neither from the model: the stream's last message may be all that is left of it)
        self.newest_gen: dict[str, int] = {}
        self.last_gen: dict[str, int] = {}

    def store(self, subject: str, data: bytes, headers: dict, now: int, dedupe: bool = True) -> int:
        msg_id = headers.get("Nats-Msg-Id")
        if dedupe and msg_id in self.ids:
            return self.ids[msg_id]
        self.last_seq += 1
        self.msgs[self.last_seq] = SimpleNamespace(seq=self.last_seq, subject=subject, data=data, headers=dict(headers),
                                                   stored_ns=now)
        self.ids[msg_id] = self.last_seq
        if "Kv-Gen" in headers and headers.get("Kv-Type") in ("batch", "reset"):
            gen = int(headers["Kv-Gen"])
            self.newest_gen[subject] = max(self.newest_gen.get(subject, gen), gen)
            self.last_gen[subject] = gen
        return self.last_seq

    def purge(self, upto: int) -> None:
        """Everything below ``upto`` (the snapshot writer's purge)."""
        for seq in range(self.first_seq, upto):
            self.msgs.pop(seq, None)
        self.first_seq = max(self.first_seq, upto)

    async def get_last_msg(self, stream: str, subject: str):
        for seq in range(self.last_seq, self.first_seq - 1, -1):
            m = self.msgs.get(seq)
            if m is not None and m.subject == subject:
                return m
        raise NotFoundError()


class InFlight:
    """The bridge's JetStream publisher: a message waits in flight until the model stores it."""

    def __init__(self) -> None:
        self.pending: list[tuple] = []

    async def publish(self, subject, data, headers, on_stored=None, on_refused=None) -> None:
        if any(p[2]["Nats-Msg-Id"] == headers["Nats-Msg-Id"] for p in self.pending):
            return
        self.pending.append((subject, data, headers, on_stored, on_refused))


class MemoryKV:
    """A KV bucket as the bridge uses it, in memory: get, put, create, and update on a revision (JetStream's
    expected last subject sequence)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.revisions: dict[str, int] = {}
        self.last = 0

    async def get(self, key: str):
        if key not in self.data:
            raise KeyNotFoundError()
        return SimpleNamespace(value=self.data[key], revision=self.revisions[key])

    async def put(self, key: str, value: bytes) -> int:
        self.last += 1
        self.data[key], self.revisions[key] = value, self.last
        return self.last

    async def create(self, key: str, value: bytes) -> int:
        if key in self.data:
            raise KeyWrongLastSequenceError()
        await self.put(key, value)
        return self.revisions[key]

    async def update(self, key: str, value: bytes, last: int) -> int:
        if key not in self.data or self.revisions[key] != last:
            raise KeyWrongLastSequenceError()
        await self.put(key, value)
        return self.revisions[key]

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)


class Engine:
    """A vLLM engine (one DP rank of a pod): what it holds (a multiset: one hash can be cached in two
    blocks), its seq and its replay buffer, and every state it went through (what an index left behind
    by a pod that stopped being watched may show)."""

    def __init__(self, pod: str, rank: int, buffer: int) -> None:
        self.pod, self.rank, self.key = pod, rank, (pod, rank)
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.held: Counter[int] = Counter()
        self.ts = itertools.count(1)
        self.states: list[frozenset[int]] = [frozenset()]
        #: the next replay answers short, in order: (batches kept, whether the end marker still came)
        self.short: deque[tuple[int, bool]] = deque()
        #: a batch of this engine may have reached no bridge by a way a catch-up covers (lost live while
        #: subscribed), or the engine restarted under a subscription that lives on (a new process that has
        #: not passed the seq published last is told by its next live batch; a new subscription's catch-up
        #: tells it): the index may lag it until the engine publishes again. Otherwise the index must hold its
        #: truth without a live batch.
        self.unseen = self.restart_unseen = False

    def publish(self, events: list[dict]) -> tuple[int, bytes]:
        seq, self.seq = self.seq, self.seq + 1
        payload = batch_payload(events, dp_rank=self.rank, ts=float(next(self.ts)) + self.seq / 1e6)
        self.buffer.append((seq, payload))
        self.states.append(frozenset(self.holds()))
        return seq, payload

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()
        self.held.clear()
        self.states.append(frozenset())

    def holds(self) -> set[int]:
        return {h for h, n in self.held.items() if n}


class Bridge:
    """One bridge incarnation: an L1 publisher with resume points and a sequencer per engine it subscribes
    to (discovery lists the pod, and the rank)."""

    def __init__(self, stream: ModelStream, kv: MemoryKV, max_batches: int) -> None:
        self.flight = InFlight()
        self.resume = ResumePoints(None, "meta")
        self.resume._store._kv = kv
        self.resume.stream_id = stream.id
        self.l1 = L1Publisher(self.flight, PREFIX, stream, STREAM, lambda: 1 << 20, "model", self.resume)
        self.metrics = Metrics()
        self.budget = ReceiveBudget(1 << 40)
        self.max_batches = max_batches
        self.seqs: dict[tuple[str, int], L1Sequencer] = {}

    def subscribe(self, e: Engine) -> L1Sequencer:
        async def replay(start: int, empty_is_failure: bool) -> Replayed:
            held = [b for b in e.buffer if b[0] >= start]
            if e.short and len(held) > e.short[0][0]:  # as the replay client returns what a ROUTER
                keep, marker = e.short.popleft()        # past its high-water mark let through
                return Replayed(self.budget, held[:keep], complete=marker)
            return Replayed(self.budget, held, complete=True)
        ep = Endpoint(e.pod, e.rank, f"tcp://{e.pod}:{5557 + e.rank}", f"tcp://{e.pod}:{5567 + e.rank}")
        seq = self.seqs[e.key] = L1Sequencer(ep, self.l1, self.metrics, replay, self.max_batches, 1 << 20)
        self.l1.watch_refusals(e.pod, e.rank, seq.refused)
        return seq

    def unsubscribe(self, key: tuple[str, int]) -> None:
        """The subscriber stopped (its batches handed on and not yet published are dropped with it)."""
        self.seqs.pop(key)
        self.l1.watch_refusals(key[0], key[1], None)

    async def position(self, key: tuple[str, int]) -> None:
        """What a new subscription does before its loop: the position from the record or the stream."""
        self.seqs[key].resume(await self.l1.last_position(*key))

    async def resume_all(self) -> None:
        for key, seq in self.seqs.items():
            await self.position(key)
            await seq.catch_up()

    async def quiet(self) -> None:
        """What the subscriber's loop does between bursts: refusals handled, runs published; and the
        publisher's own task: a removal that a retired message was stored after, published again."""
        await self.l1.republish_owed()
        for seq in self.seqs.values():
            if seq.refused_upto is not None:
                await seq.after_refusal()
            await seq.flush()

    def resets(self) -> dict[str, float]:
        return {s.labels["reason"]: s.value for s in self.metrics.bridge_resets.collect()[0].samples
                if s.name.endswith("_total") and s.value}


def _worker(headers: dict) -> tuple[str, int] | None:
    """The (pod, rank) of a batch or reset message in flight (None: a pod's or rank's removal)."""
    if headers["Kv-Type"] not in ("batch", "reset"):
        return None
    return headers["Kv-Pod"], int(headers["Kv-Dp-Rank"])


class Sequencing(RuleBasedStateMachine):
    buffer = 100000  # the engines' replay buffer, in batches
    refusals = False  # whether the stream may refuse a message for good (its batches are then lost)
    max_early = 1024  # early messages the indexer holds per worker before it spills (reads back) the rest
    max_journal = 1024  # messages of a generation applied before its reset, kept for a late reset

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.stream = ModelStream()
        self.kv = MemoryKV()
        self.engines = [Engine(pod, rank, self.buffer) for pod, rank in WORKERS]
        self.by_key = {e.key: e for e in self.engines}
        self.usual_path = {WORKERS[0]}  # the first engine's batches go as the subscriber hands them on
        self.now = time.time_ns()  # generations are the bridge's wall clock: the stream's must agree
        self.bridge = Bridge(self.stream, self.kv, 4)
        for e in self.engines:
            self.bridge.subscribe(e)
        #: discovery: the pods listed, and each pod's ranks (a rank is subscribed while both list it)
        self.present: set[str] = set(PODS)
        self.listed: dict[str, set[int]] = {pod: {r for p, r in WORKERS if p == pod} for pod in PODS}
        #: pods that left discovery within ``removalGrace`` (still indexed, not subscribed)
        self.away: set[str] = set()
        self.state = L1State(self.max_early, self.max_journal)
        self.applied = 0
        self.snapshot: tuple[bytes, int] | None = None
        self.resets: Counter[str] = Counter()  # of the bridges replaced
        #: subscriptions that may start a generation: the first, and a new subscription's where neither a
        #: resume record nor the stream still says where the engine stands (records not written yet,
        #: purged), or where its pod or rank was removed since
        self.fresh_starts = len(WORKERS)
        #: workers the current bridge resumed from a position it could check, and a records write since: a
        #: new bridge can resume them even once the stream's messages are purged (judged by the model, as the
        #: code's own records are what is tested); both forget a worker when its engine publishes or
        #: restarts. A worker whose engine restarted since it last published is not resumed but started anew.
        self.resumed: set[tuple[str, int]] = set()
        self.recorded: set[tuple[str, int]] = set()
        self.restarted: set[tuple[str, int]] = set()
        self.chains = itertools.count(1)
        self.quiet_points = 0
        #: bridges replaced while they lived on (bridge_replaced, ``lingering``), with the acks that reach them
        #: late: their records write to come
        self.lingering: list[tuple[Bridge, list]] = []
        #: the stream was created again and the bridge has not noticed yet (its acks, or its look every
        #: STREAMS_CHECK_EVERY: bridge/service.py)
        self.stream_unnoticed = False
        #: pods away within their grace when the stream was lost: retries of their batches may have been
        #: stored on the new one, a part of some state their engine went through
        self.lost_with_stream: set[str] = set()
        #: DP ranks of pods away whose removal a killed bridge left to the next through the targets record
        #: (bridge/service.py ``_ranks_unlisted``): it was stored on a stream lost since while a message it
        #: retired was in flight. The record cannot tell them from the pod's listed ranks, so the next bridge
        #: removes them once the pod is back, or with the pod; meanwhile a retry of that message stored on
        #: the new stream may show a part of what the rank held
        self.removing: set[tuple[str, int]] = set()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    # -- engines -------------------------------------------------------------------------------------
    def _event(self, e: Engine, kind: str, n: int, twice: bool) -> tuple[int, bytes] | None:
        """The engine does something and publishes it (into its buffer); None: nothing to publish."""
        if kind == "store":
            base = next(self.chains) * 1000
            hashes = [base + k for k in range(n)]
            if twice and e.held:  # a hash the engine holds cached again in another block
                hashes.append(min(e.held))
            events = [stored(hashes, block_size=4)]
            e.held.update(hashes)
        elif kind == "evict":
            held = sorted(e.holds())[:n]
            events = [removed(held)] if held else []
            e.held.subtract(held)
        else:
            events = [cleared()]
            e.held.clear()
        if not events:
            return None
        self.resumed.discard(e.key)
        self.recorded.discard(e.key)
        return e.publish(events)

    def _deliver(self, e: Engine, seq: int, payload: bytes) -> None:
        """A live batch reaches the engine's subscription (the bridge sees a restart, a new generation,
        only in a batch of the new process)."""
        self.restarted.discard(e.key)
        sequencer = self.bridge.seqs[e.key]
        # as the subscriber hands a batch on: the path without a coroutine where it takes the batch
        # (the usual one), else on_message; every other chain takes on_message alone
        if e.key in self.usual_path and sequencer.take_usual(seq, payload):
            if sequencer.pending.full():
                self.run(sequencer.flush())
        else:
            self.run(sequencer.on_message(seq, payload))
        self.run(self.bridge.quiet())
        e.unseen = e.restart_unseen = False  # its gap, if any, filled from the buffer

    @rule(i=st.integers(0, len(WORKERS) - 1), kind=st.sampled_from(["store", "store", "store", "evict", "clear"]),
          n=st.integers(1, 4), live=st.booleans(), twice=st.booleans())
    def engine_publishes(self, i, kind, n, live, twice):
        """Live, or lost on the way (a ZMQ drop: a gap the next live batch shows); an engine no bridge
        subscribes to (its pod or rank not listed) publishes into its buffer alone."""
        e = self.engines[i]
        batch = self._event(e, kind, n, twice)
        if batch is not None and e.key in self.bridge.seqs:
            if live:
                self._deliver(e, *batch)
            else:
                e.unseen = True

    @rule(i=st.integers(0, len(WORKERS) - 1), count=st.integers(2, 6))
    def engine_bursts(self, i, count):
        """Several batches in a row: more than one message of a worker in flight at once."""
        for _ in range(count):
            self.engine_publishes(i, "store", 1, True, False)

    @rule(i=st.integers(0, len(WORKERS) - 1))
    def engine_restarts(self, i):
        """A new engine process: seq from 0, an empty buffer and cache, and a new TCP connection, which
        the subscriber's socket monitor reports (the sequencer then checks the next batch's incarnation)."""
        e = self.engines[i]
        e.restart()
        e.restart_unseen = True
        self.resumed.discard(e.key)
        self.recorded.discard(e.key)
        self.restarted.add(e.key)
        if e.key in self.bridge.seqs:
            self.bridge.seqs[e.key].reconnected = True

    @rule(i=st.integers(0, len(WORKERS) - 1), keep=st.integers(1, 3), marker=st.booleans())
    def engine_answers_short(self, i, keep, marker):
        """The engine's next replay answer longer than ``keep`` batches brings only its first ``keep``: its
        ROUTER dropped the rest past its send high-water mark, and the end marker came or was dropped too
        (the first batch of an answer always comes: the pipe to a new request is empty)."""
        self.engines[i].short.append((keep, marker))

    # -- discovery: flaps, removals, DP ranks ------------------------------------------------------------
    def subscribed(self, key: tuple[str, int]) -> bool:
        return key[0] in self.present and key[1] in self.listed[key[0]]

    def _subscribe(self, key: tuple[str, int], contact: str, fresh: bool) -> None:
        """A new subscription (bridge/service.py ``_subscribe_to``, the subscriber's loop): the position from
        the record or the stream, then the catch-up, a first contact where there is none. ``contact``: the
        engine is quiet; a live batch already waits (``queued``: the catch-up leaves a first contact to it);
        a batch went into the buffer just before the catch-up asked and arrives live after it (``raced``).
        ``fresh``: the pod or rank was removed since (its generation retired): a new one is expected."""
        e = self.by_key[key]
        checkable = (not fresh and not self._newer_in_flight(key)
                     and (self.checkable_position(key) or key in self.recorded))
        if not checkable or key in self.restarted:
            # An engine restarted while unsubscribed is started anew whatever the records say: the catch-up
            # finds the new process (its batch at the recorded seq is another), a reset of the subscription
            # (SEQUENCING_SEED=186143725: restarted, bridge killed twice, pod away, purge, back quiet).
            self.fresh_starts += 1
        else:
            self.resumed.add(key)
        seq = self.bridge.subscribe(e)
        self.run(self.bridge.position(key))
        batch = self._event(e, "store", 1, False) if contact in ("queued", "raced") else None
        self.run(seq.catch_up(first_contact=contact != "queued"))
        if batch is not None:
            self._deliver(e, *batch)
        self.run(self.bridge.quiet())
        e.unseen = e.restart_unseen = False  # the catch-up published what the engine's buffer holds

    @precondition(lambda self: self.present)
    @rule(p=st.integers(0, 10**6))
    def pod_leaves(self, p):
        """A pod leaves discovery (a readiness flap, or for good): its subscribers stop; it stays indexed
        for ``removalGrace``."""
        pod = sorted(self.present)[p % len(self.present)]
        self.present.discard(pod)
        self.away.add(pod)
        for rank in sorted(self.listed[pod]):
            self.bridge.unsubscribe((pod, rank))

    @precondition(lambda self: self.away)
    @rule(p=st.integers(0, 10**6))
    def grace_ends(self, p):
        """Gone longer than the grace: ``pod_removed`` (its record deleted first)."""
        pod = sorted(self.away)[p % len(self.away)]
        self.away.discard(pod)
        self.lost_with_stream.discard(pod)
        self.removing = {key for key in self.removing if key[0] != pod}
        self._retired(lambda key: key[0] == pod)
        self.run(self.bridge.l1.pod_removed(pod, "discovery"))

    def _retired(self, which) -> None:
        """Workers a removal retires: their record is gone (its mark retires their generations), so a record
        written later does not name them, whatever the model saw them resume from before
        (SEQUENCING_SEED=2057677783: a pod removed, its removal lost with a killed bridge, the records
        written by the next before the pod came back: the bridge rightly started it anew)."""
        self.resumed = {key for key in self.resumed if not which(key)}
        self.recorded = {key for key in self.recorded if not which(key)}

    @precondition(lambda self: len(self.present) < len(PODS))
    @rule(p=st.integers(0, 10**6), contact=st.sampled_from(["quiet", "queued", "raced"]))
    def pod_returns(self, p, contact):
        """Back within the grace (it resumes where it stopped), or after its removal (a new generation)."""
        gone = [pod for pod in PODS if pod not in self.present]
        pod = gone[p % len(gone)]
        fresh = pod not in self.away
        self.away.discard(pod)
        self.lost_with_stream.discard(pod)
        self.present.add(pod)
        for rank in sorted(self.listed[pod]):
            self._subscribe((pod, rank), contact, fresh)
        self._remove_inherited(pod)

    def _remove_inherited(self, pod: str) -> None:
        """The ranks of a pod listed whose removal the targets record kept: removed (``_reconcile_targets``)."""
        for key in sorted(k for k in self.removing if k[0] == pod and k[1] not in self.listed[pod]):
            self.removing.discard(key)
            self._retired(lambda k: k == key)
            self.run(self.bridge.l1.rank_removed(*key, "discovery"))

    def _ranks(self, listed: bool) -> list[tuple[str, int]]:
        """Ranks of present pods of several ranks that are (or are not) listed; a pod keeps one at least."""
        return [(pod, rank) for pod, rank in WORKERS if pod in self.present and len(self.listed[pod]) > listed
                and sum(p == pod for p, _ in WORKERS) > 1 and (rank in self.listed[pod]) == listed]

    @precondition(lambda self: self._ranks(True))
    @rule(i=st.integers(0, 10**6))
    def rank_leaves(self, i):
        """One DP rank unlisted while its pod stays (``dpRanks`` shrunk, the rank unregistered): its
        subscriber stops, then ``rank_removed``. Its engine may go on publishing into its buffer."""
        candidates = self._ranks(True)
        pod, rank = candidates[i % len(candidates)]
        self.listed[pod].discard(rank)
        self.bridge.unsubscribe((pod, rank))
        self._retired(lambda key: key == (pod, rank))
        self.run(self.bridge.l1.rank_removed(pod, rank, "discovery"))

    @precondition(lambda self: self._ranks(False))
    @rule(i=st.integers(0, 10**6), contact=st.sampled_from(["quiet", "queued", "raced"]))
    def rank_returns(self, i, contact):
        """The rank listed again: a new generation from its engine's buffer (its old one was retired)."""
        candidates = self._ranks(False)
        pod, rank = candidates[i % len(candidates)]
        self.listed[pod].add(rank)
        self._subscribe((pod, rank), contact, fresh=True)

    # -- the stream ----------------------------------------------------------------------------------
    @precondition(lambda self: self.bridge.flight.pending)
    @rule(k=st.integers(0, 10**6), dup=st.booleans())
    def stored_late(self, k, dup):
        """One message in flight is stored (any of them: retries arrive late and out of order); maybe a
        copy again past the duplicate window."""
        subject, data, headers, on_stored, _ = self.bridge.flight.pending.pop(k % len(self.bridge.flight.pending))
        seq = self.stream.store(subject, data, headers, self.now)
        if dup:
            self.stream.store(subject, data, headers, self.now, dedupe=False)
        if on_stored is not None:
            on_stored(seq)
        if self.stream_unnoticed:  # an ack from the new stream (its sequence went back) tells the bridge
            self.bridge_notices_the_new_stream()
        self.run(self.bridge.quiet())

    @precondition(lambda self: self.refusals and any(_worker(e[2]) for e in self.bridge.flight.pending))
    @rule(k=st.integers(0, 10**6))
    def refused(self, k):
        """A batch or reset refused for good (a removal is a few bytes: nothing the stream refuses a
        message for, its size, applies to it)."""
        refusable = [e for e in self.bridge.flight.pending if _worker(e[2])]
        entry = refusable[k % len(refusable)]
        self.bridge.flight.pending.remove(entry)
        _, _, headers, _, on_refused = entry
        if on_refused is not None and headers["Kv-Type"] == "batch":
            on_refused()
        self.run(self.bridge.quiet())

    def store_all(self, rng: random.Random | None = None) -> None:
        while self.bridge.flight.pending:
            self.stored_late(rng.randrange(1 << 20) if rng else 0, False)

    def _store_now(self, keep, late_acks: list | None = None) -> None:
        """Store the messages in flight that ``keep`` picks, in order; their acks into ``late_acks`` (to come
        later) where given."""
        for entry in [e for e in self.bridge.flight.pending if keep(e)]:
            self.bridge.flight.pending.remove(entry)
            seq = self.stream.store(entry[0], entry[1], entry[2], self.now)
            if entry[3] is not None:
                if late_acks is None:
                    entry[3](seq)
                else:
                    late_acks.append((entry[3], seq))

    # -- the bridge ----------------------------------------------------------------------------------
    @rule()
    def records_written(self):
        """A write of the resume records: a worker resumed from the stream's last message is recorded once
        the buffer published again up to it is stored (its acks move the position)."""
        self.run(self.bridge.resume.write())
        in_flight = {_worker(e[2]) for e in self.bridge.flight.pending}
        self.recorded |= self.resumed - in_flight

    @rule(graceful=st.booleans(), records_first=st.booleans(), upgrade=st.booleans(), lingering=st.booleans())
    def bridge_replaced(self, graceful, records_first, upgrade, lingering=False):
        """kill -9 (what is in flight, and resume points not written yet, are lost; maybe right after a
        write of them), or SIGTERM or a standby taking over after a clean stop. ``lingering``: not killed, it
        lost its lease (a NATS outage) or its pods' shards, and lives on: what it had in flight is lost to
        it as to a killed one, but it writes its records later (``lingering_bridge_writes``), after the next
        bridge has moved on. ``upgrade``: the bridge
        replaced is a version from before the resume records (it kept none), stopped by the rolling update,
        so the new one resumes every worker from the stream's last message, and publishes the engine's
        buffer up to it again. Around a removal too: the new bridge subscribes to what discovery lists; a
        pod away within its grace it inherits (from the targets record) as leaving, a removal lost in
        flight it publishes again (bridge/service.py)."""
        # Open (docs/operations.md, recovery; found by a 1,500-run hunt): after the stream refused a message, a new
        # generation began while older ones of the old generation were still in flight; one stored after
        # the new reset is the subject's last message, and a bridge with no record (an upgrade) resumes
        # that old generation, whose batches the indexers then drop as stale. Upgrades are drawn only
        # where nothing is refused.
        upgrade = upgrade and not self.refusals
        graceful = graceful or upgrade
        if self.stream_unnoticed:  # open too (as above): killed after a stream's loss before any ack told it
            self.bridge_notices_the_new_stream()
        late: list = []  # acks that reach a lingering bridge after the handover
        # the targets record as the bridge last wrote it (it writes it again as soon as this changes)
        inherited = set() if graceful else self.bridge.l1.unstored_removals()
        if records_first:
            self.records_written()
        if not graceful:
            # What is in flight is lost with the bridge, in any part: a new generation's reset with a later
            # batch of it stored, before any record of it (the next bridge resumes from that batch and
            # publishes the reset again with the buffer). Open (docs/operations.md, recovery): messages of an
            # older generation of the worker (superseded after a refusal) are lost with the bridge here;
            # stored after the newer one's, they would be the open window above, which a bridge with no
            # record of the worker (killed before its first write) reaches as an upgrade does.
            # Open too (the module's doc): (D) a pod away within its grace has no subscription to publish
            # again a message lost with the bridge; past EARLY_TIMEOUT_NS the indexers declare the hole
            # lost (the worker cleared, the same generation going on), and the pod back within the grace
            # resumes that generation: what the clear took is not published again. The model stores
            # those first; and a rank_removed, or a removal being published again after a retired
            # message stored late, which the next bridge publishes from the targets record (not modelled).
            self._store_now(lambda e: e[2]["Kv-Type"] == "rank_removed"
                            or ":removed:after:" in e[2]["Nats-Msg-Id"]
                            or e[2]["Kv-Pod"] not in self.present and _worker(e[2]) is not None,
                            late_acks=late if lingering else None)
            # A worker's first position of a generation is written at once (ResumePoints.update: the write
            # loop writes what is due at once within milliseconds): killed after that. (Before it, the open
            # window above: an older generation's message stored last, with no record to say otherwise.)
            self.run(self.bridge.resume.write(urgent_only=True))
        if graceful:
            self.run(self.bridge.quiet())
            self.store_all()
            self.records_written()
        lost = [e[2] for e in self.bridge.flight.pending if _worker(e[2]) is None]
        # The same open window without a refusal (SEQUENCING_SEED=13): a pod back with a new generation
        # (its position named no vLLM timestamp) while the older one's batch was in flight, stored after
        # the newer one's messages. An upgrade then is a plain replacement (the records kept).
        upgrade = upgrade and not self._older_generation_last()
        if upgrade:
            self.kv.data = {k: v for k, v in self.kv.data.items() if not k.startswith(KEY_PREFIX)}
            self.recorded.clear()
            # the bridges before it were of that version too: one still living writes no records
            # (SEQUENCING_SEED=3026120432: one that did re-created a record the upgrade had not got)
            self.lingering.clear()
        self.resets.update(self.bridge.resets())
        old = self.bridge
        if lingering and not graceful:
            self.lingering.append((old, late))
        else:
            for on_stored, seq in late:
                on_stored(seq)
        self.bridge = Bridge(self.stream, self.kv, old.max_batches)
        # The window left open (docs/operations.md, recovery): a bridge knows in memory only which
        # generations began on a stream it found lost; the next one would resume a generation of a pod away
        # then, from a retry of its batch stored on the new stream. The model hands it on.
        self.bridge.l1.lost_before = old.l1.lost_before
        for key, seq in old.seqs.items():  # judged from the model's own KV and stream, not the code's
            if seq.gen is not None and not self.checkable_position(key) and (
                    key not in self.recorded or self._removal_after_record(key)):
                self.fresh_starts += 1
        keys = [e.key for e in self.engines if self.subscribed(e.key)]
        self.resumed = {key for key in keys if (self.checkable_position(key) or key in self.recorded)
                        and key not in self.restarted}
        for key in keys:
            self.bridge.subscribe(self.by_key[key])
        self.run(self.bridge.resume_all())
        for key in keys:  # each caught up from what its engine's buffer holds
            self.by_key[key].unseen = self.by_key[key].restart_unseen = False
        for headers in lost:  # a pod_removed lost in flight: the pod is inherited (the targets record),
            pod = headers["Kv-Pod"]  # leaving, and removed when its (new) grace ends
            if headers["Kv-Type"] == "pod_removed" and pod not in self.present:
                self.away.add(pod)
        in_flight = {(h["Kv-Pod"], None if h["Kv-Type"] == "pod_removed" else int(h["Kv-Dp-Rank"])) for h in lost}
        # stored on a stream lost since, what they retired in flight: inherited likewise (pods first)
        for pod, rank in sorted(inherited - in_flight, key=lambda k: (k[1] is not None, str(k))):
            if rank is None:
                if pod not in self.present:
                    self.away.add(pod)
                    self.lost_with_stream.add(pod)
            elif pod in self.away or pod in self.present:
                self.removing.add((pod, rank))
                if pod in self.present:
                    self._remove_inherited(pod)
        self.run(self.bridge.quiet())

    @precondition(lambda self: self.lingering)
    @rule()
    def lingering_bridge_writes(self):
        """A bridge replaced while it lived on writes its resume records (its write loop's interval, or a
        failed write tried again), from what it knew and from the acks that reached it: it must not undo
        what the bridges after it wrote (the chaos soak, sharded, CHAOS_SEED=421964534: a rank's removal
        mark overwritten, and the retired generation resumed)."""
        old, late = self.lingering.pop(0)
        for on_stored, seq in late:
            on_stored(seq)
        self.run(old.resume.write())

    def checkable_position(self, key: tuple[str, int]) -> bool:
        """Whether a new subscription can know where the engine stands, and check it is the same engine
        process: its resume record (or its last stream message, where that is of a newer generation) names
        a batch with vLLM's timestamp (a reset names none: a new generation then starts from the engine's
        buffer), and neither the pod nor the rank was removed after it."""
        pod, rank = key
        last = self._last(l1_subject(PREFIX, pod, rank))
        record = msgpack.unpackb(self.kv.data[record_key(pod)], strict_map_key=False) \
            if self.kv.data.get(record_key(pod)) else {}
        row = (record.get("ranks") or {}).get(rank) if record.get("stream") == self.stream.id else None
        # a removal's mark the record keeps (bridge/resume_points.py): what it retired is never resumed
        tomb = max(record.get("retired", -1), (record.get("retiredRanks") or {}).get(rank, -1))
        if last is not None and last.headers["Kv-Type"] == "rank_removed":
            return False
        gen = row[0] if row is not None else int(last.headers["Kv-Gen"]) if last is not None else -1
        if gen <= tomb or gen < self.bridge.l1.lost_before:  # retired, or begun on a stream lost since
            return False
        removal = self._last(l1_lifecycle_subject(PREFIX, pod))  # it retired generations before its mark
        retired, removed_at = (int(removal.headers["Kv-Gen"]), removal.seq) if removal is not None else (-1, -1)
        if row is not None:
            if last is not None and int(last.headers["Kv-Gen"]) > row[0]:
                return False  # a generation younger than the record: started anew
            return row[3] is not None and row[0] >= retired and row[4] > removed_at
        return (last is not None and last.headers["Kv-Type"] == "batch"
                and int(last.headers["Kv-Gen"]) >= retired and last.seq > removed_at)

    def _removal_after_record(self, key: tuple[str, int]) -> bool:
        """Whether the stream stored the pod's last removal after the message the worker's record names: a
        removal re-sent late, or one that retired a newer generation than its own mark shows, looks the
        same from the stream, so the bridge starts anew (SEQUENCING_SEED=1843694871: a pod back while its
        removal was in flight, a batch of its new generation stored before the removal)."""
        pod, rank = key
        record = self.kv.data.get(record_key(pod))
        row = msgpack.unpackb(record, strict_map_key=False)["ranks"].get(rank) if record else None
        removal = self._last(l1_lifecycle_subject(PREFIX, pod))
        return row is not None and removal is not None and removal.seq > row[4]

    def _newer_in_flight(self, key: tuple[str, int]) -> bool:
        """Whether a generation of the worker newer than any the record or the stream shows is in flight
        (the bridge started it, and it is not stored yet): resuming the older one would lose what follows."""
        gens = [int(e[2]["Kv-Gen"]) for e in self.bridge.flight.pending if _worker(e[2]) == key]
        if not gens:
            return False
        last = self._last(l1_subject(PREFIX, *key))
        record = self.kv.data.get(record_key(key[0]))
        row = msgpack.unpackb(record, strict_map_key=False)["ranks"].get(key[1]) if record else None
        shown = max(row[0] if row else -1, int(last.headers.get("Kv-Gen", -1)) if last is not None else -1)
        return max(gens) > shown

    def _older_generation_last(self) -> bool:
        """Whether some worker's last message on the stream is of an older generation than one stored
        before it on its subject, purged since or not (SEQUENCING_SEED=3783171625: the newer generation's
        messages purged behind a snapshot, the older one's batch stored after them left as the last)."""
        last, newest = self.stream.last_gen, self.stream.newest_gen
        return any(gen < newest[s] for s, gen in last.items())

    def _last(self, subject: str):
        return max((m for m in self.stream.msgs.values() if m.subject == subject), key=lambda m: m.seq, default=None)

    # -- the stream lost ---------------------------------------------------------------------------
    @rule()
    def stream_recreated(self):
        """The stream deleted (an operator, storage lost) and created again by another process (a replica's
        lag round): what it held is lost, and so is every snapshot of it; the replica rebuilds from the new
        one. Messages in flight are stored on the new one (their retries), and the bridge goes on
        publishing to it mid-generation until it notices (``bridge_notices_the_new_stream``). The resume
        records name the old one: no new bridge resumes from them."""
        self.stream.recreate()
        self.state, self.applied, self.snapshot = L1State(self.max_early, self.max_journal), 0, None
        self.recorded.clear()
        self.resumed.clear()
        # and pods whose removal is in flight: one lost with a killed bridge leaves the pod inherited as away
        self.lost_with_stream |= self.away | {e[2]["Kv-Pod"] for e in self.bridge.flight.pending
                                              if e[2]["Kv-Type"] == "pod_removed"}
        self.stream_unnoticed = True

    @precondition(lambda self: self.stream_unnoticed)
    @rule()
    def bridge_notices_the_new_stream(self):
        """What the bridge does once an ack's sequence went back, or its look at the streams finds the last
        message it was acked gone or another (bridge/service.py ``_restore_streams``): the new stream's id
        for its records, no generation begun before resumed, and every subscription started over from its
        engine's buffer (VllmSubscriber.start_over)."""
        self.stream_unnoticed = False
        self.lost_with_stream |= self.away  # left since, their batches published to the new stream meanwhile
        self.bridge.resume.stream_id = self.stream.id
        self.bridge.l1.stream_lost()
        for seq in self.bridge.seqs.values():
            seq.start_over()
        for key, seq in self.bridge.seqs.items():
            self.fresh_starts += 1
            self.run(seq.catch_up(first_contact=True))
            self.by_key[key].unseen = self.by_key[key].restart_unseen = False
        self.run(self.bridge.quiet())

    # -- the indexer ---------------------------------------------------------------------------------
    def apply_stored(self) -> None:
        for seq in range(max(self.applied + 1, self.stream.first_seq), self.stream.last_seq + 1):
            m = self.stream.msgs[seq]
            try:
                self.state.apply(msgpack.unpackb(m.data, raw=False), m.stored_ns, seq)
                self.read_back(seq)
            except ValueError as exc:  # counted by the service; the model's messages are all plausible
                raise AssertionError(f"stream seq {seq} refused: {exc}") from exc
            self.applied = seq

    def read_back(self, upto: int, state: L1State | None = None) -> None:
        """What the service does after each message: a spilled message a worker's cursor reached is read
        back from the stream by its stream sequence, until none is due. Each message's read-back is cut
        off once before it starts (the consumer made again while JetStream did not answer): the message
        comes again, and what it made due is due again."""
        state = self.state if state is None else state
        cut_off = True
        while (due := state.read_back_due()) is not None:
            if cut_off:
                cut_off, m = False, self.stream.msgs[upto]
                state.apply(msgpack.unpackb(m.data, raw=False), m.stored_ns, upto)
                assert state.read_back_due() == due, "a read-back cut off is due again"
            (pod, rank), at = due
            assert self.stream.first_seq <= at < upto, "purged past what a worker has to read back"
            m = self.stream.msgs[at]
            assert m.subject == f"{PREFIX}.{pod.replace('.', '_')}.{rank}"
            state.read_back_taken((pod, rank), at)
            state.apply(msgpack.unpackb(m.data, raw=False), m.stored_ns, at, read_back=True)

    @rule(keep=st.integers(0, 5))
    def snapshot_and_purge(self, keep):
        self.apply_stored()
        if not self.applied:
            return
        self.snapshot = (encode_l1(self.state, self.applied), self.applied)
        cut = self.applied + 1 - keep
        floor = self.state.purge_floor(cut)  # as the service purges: never past what a replica reads back
        self.stream.purge(min(cut, floor) if floor else cut)

    @rule()
    def indexer_restarts(self):
        if self.snapshot is None:
            self.state, self.applied = L1State(self.max_early, self.max_journal), 0
            assert self.stream.first_seq == 1, "purged only behind a snapshot"
        else:
            self.state, self.applied = decode_l1(self.snapshot[0])
            self.state.max_early, self.state.max_journal = self.max_early, self.max_journal

    @rule(seconds=st.integers(0, 120))
    def time_passes(self, seconds):
        """Retries arrive within the ack timeout: what is in flight is stored before much time passes."""
        self.store_all()
        self.now += seconds * 10**9

    # -- the truth -----------------------------------------------------------------------------------
    def teardown(self) -> None:
        try:
            self.at_a_quiet_point_the_index_is_the_engines_truth()
        finally:
            self.loop.close()

    @rule()
    def at_a_quiet_point_the_index_is_the_engines_truth(self):
        """A quiet point: everything in flight is stored and applied, and a subscribed engine with nothing
        unseen (``Engine.unseen``) is whole in the index already: a catch-up is for engines that stay quiet.
        Then each subscribed engine's latest batch arrives live (one lost on the way with nothing after it
        cannot be seen by anyone until the engine publishes again), and again all is stored and applied. A pod away within its grace keeps what its index held
        when it was last watched (some state its engine went through); a pod or rank removed holds nothing."""
        self.quiet_points += 1
        if self.stream_unnoticed:  # within STREAMS_CHECK_EVERY at the latest
            self.bridge_notices_the_new_stream()
        rng = random.Random(self.quiet_points)  # the order things are stored in: replayable
        whole = self.buffer >= 100000 and not self.refusals
        if whole:  # first without a live batch: a quiet engine the bridge caught up is whole already
            self.store_all(rng)
            self.apply_stored()
            for e in self.engines:
                if e.key in self.bridge.seqs and not e.unseen and not e.restart_unseen:
                    wid = self.state.workers.get(e.pod, e.rank)
                    index = set() if wid is None else {h for h, m in self.state.blocks.items() if m >> wid & 1}
                    assert index == e.holds(), (f"{e.pod} rank {e.rank}, quiet and caught up: index {sorted(index)} "
                                                f"!= engine {sorted(e.holds())}")
        for i, e in enumerate(self.engines):
            if e.key in self.bridge.seqs:
                self.engine_publishes(i, "store", 1, True, False)
        self.store_all(rng)
        self.apply_stored()
        for e in self.engines:
            wid = self.state.workers.get(e.pod, e.rank)
            index = set() if wid is None else {h for h, m in self.state.blocks.items() if m >> wid & 1}
            where = f"{e.pod} rank {e.rank}"
            if e.key in self.bridge.seqs:
                if whole:
                    assert index == e.holds(), f"{where}: index {sorted(index)} != engine {sorted(e.holds())}"
                else:
                    assert index <= e.holds(), f"{where}: index holds {sorted(index - e.holds())} the engine does not"
            elif e.pod in self.away and (e.rank in self.listed[e.pod] or e.key in self.removing):
                if whole and e.pod not in self.lost_with_stream and e.key not in self.removing:
                    assert index in e.states, f"{where} (away): index {sorted(index)} was never the engine's"
                else:
                    ever = set().union(*e.states)
                    assert index <= ever, f"{where} (away): index holds {sorted(index - ever)} the engine never did"
            else:
                assert not index, f"{where} (removed): index still holds {sorted(index)}"
        resets = self.resets + Counter(self.bridge.resets())
        if whole:
            unexpected = {r: n for r, n in resets.items() if r not in ("subscribed", "idle", "engine-restart")}
            assert not unexpected, f"generations started without need: {unexpected}"
            assert resets["subscribed"] <= self.fresh_starts, "a bridge started over where it could resume"


#: runs of STEPS steps each, EXAMPLES runs a class (``SEQUENCING_EXAMPLES=2000 pytest --timeout=0 ...`` for a
#: longer hunt). The seed is random per session and printed; ``SEQUENCING_SEED=N`` replays a whole run.
EXAMPLES = int(os.environ.get("SEQUENCING_EXAMPLES", "400"))
STEPS = 40
SEED = int(os.environ.get("SEQUENCING_SEED") or random.SystemRandom().randrange(1 << 32))


def _settings() -> settings:
    return settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))


def _seeded(machine: type[RuleBasedStateMachine]):
    """The machine's test case, run from SEED (printed, so a failure in CI can be replayed)."""
    seed(SEED)(machine)
    case = machine.TestCase
    case.settings = _settings()
    run = case.runTest

    def runTest(self):
        print(f"SEQUENCING_SEED={SEED} ({machine.__name__}: {EXAMPLES} runs of up to {STEPS} steps)")
        run(self)
    runTest.__dict__.update(run.__dict__)  # what marks it a Hypothesis test
    case.runTest = runTest
    return case


test_the_sequencing_keeps_the_index_equal_to_the_engines = _seeded(Sequencing)


class LossySequencing(Sequencing):
    """Replay buffers of 3 batches and refused messages: history is lost, ratios may only be too low."""
    buffer = 3
    refusals = True


test_with_history_lost_the_index_never_holds_what_the_engine_does_not = _seeded(LossySequencing)


def _held(state: L1State, e: Engine) -> set[int]:
    wid = state.workers.get(e.pod, e.rank)
    return set() if wid is None else {h for h, m in state.blocks.items() if m >> wid & 1}


class SpillingSequencing(Sequencing):
    """An indexer that holds one early message per worker: the rest is spilled and read back from the
    stream (issue 36 #3); the index must still equal the engines at every quiet point, with no gap lost.
    (The journal of a generation stored before its reset keeps its own bound: it is not read back.)"""
    max_early = 1

    def __init__(self) -> None:
        super().__init__()
        #: a second replica behind the one that writes snapshots and purges (within ``keep`` of it or not)
        self.lagging, self.lagging_applied = L1State(self.max_early, self.max_journal), 0

    def stream_recreated(self):
        super().stream_recreated()
        self.lagging, self.lagging_applied = L1State(self.max_early, self.max_journal), 0

    @precondition(lambda self: len(self.bridge.flight.pending) >= 3)
    @rule()
    def stored_batches_newest_first(self):
        """Everything in flight stored, resets and removals first, then the batches newest first (retries
        arriving late, in reverse): a worker with three or more batches in flight has early ones past
        ``max_early``, which spill. (Stored one at a time in any order, about 1 run in 100 spilled.)"""
        pending = self.bridge.flight.pending
        order = [e for e in pending if e[2]["Kv-Type"] != "batch"] + [e for e in pending if e[2]["Kv-Type"] == "batch"][::-1]
        pending.clear()
        for subject, data, headers, on_stored, _ in order:
            seq = self.stream.store(subject, data, headers, self.now)
            if on_stored is not None:
                on_stored(seq)
        self.run(self.bridge.quiet())

    @rule(behind=st.integers(0, 8))
    def lagging_replica_follows(self, behind):
        """The second replica applies the stored messages up to ``behind`` before the last, reading back as
        it goes; where the purge took its next message it reloads from the newest snapshot, as the service
        does."""
        if self.lagging_applied + 1 < self.stream.first_seq:
            assert self.snapshot is not None, "purged only behind a snapshot"
            self.lagging, self.lagging_applied = decode_l1(self.snapshot[0])
            self.lagging.max_early, self.lagging.max_journal = self.max_early, self.max_journal
        for seq in range(self.lagging_applied + 1, self.stream.last_seq - behind + 1):
            m = self.stream.msgs[seq]
            self.lagging.apply(msgpack.unpackb(m.data, raw=False), m.stored_ns, seq)
            self.read_back(seq, self.lagging)
            self.lagging_applied = seq

    def at_a_quiet_point_the_index_is_the_engines_truth(self):
        super().at_a_quiet_point_the_index_is_the_engines_truth()
        assert not self.state.stats.lost_gaps, "a gap declared lost while the stream holds every batch"
        self.lagging_replica_follows(0)
        for e in self.engines:
            assert _held(self.lagging, e) == _held(self.state, e), \
                f"{e.pod} rank {e.rank}: the replica behind, caught up, holds what the one ahead holds"
        assert not self.lagging.stats.lost_gaps


test_an_indexer_that_spills_early_batches_keeps_the_index_equal_to_the_engines = _seeded(SpillingSequencing)


def test_the_usual_path_declines_what_only_on_message_judges():
    """``take_usual`` (the subscriber's path without a coroutine) hands on only the next batch of a settled
    subscription, in vLLM's current shape, with no blockKey check due; the rest (the first batch, a gap,
    a seq gone back, a socket that connected again, a check due, another shape, garbage) is left to
    ``on_message`` with nothing changed."""
    ep = Endpoint("10.0.0.1", 0, "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5567")
    seq = L1Sequencer(ep, None, Metrics(), None, 4, 1 << 20)
    usual = batch_payload([stored([1, 2], block_size=4)])
    legacy = msgpack.packb([1.0, [["BlockStored", [1, 2], None, [1, 2, 3, 4], 4]]], use_bin_type=True)
    assert not seq.take_usual(0, usual)  # the first batch
    seq.gen, seq.last = 1, 5
    for n, payload in ((7, usual), (5, usual), (6, legacy), (6, b"\xc1 not msgpack")):
        assert not seq.take_usual(n, payload)
    seq.reconnected = True
    assert not seq.take_usual(6, usual)
    seq.reconnected = False
    seq.block_key_check = SimpleNamespace(due=lambda pod: True)
    assert not seq.take_usual(6, usual)
    seq.block_key_check = None
    assert seq.last == 5 and not seq.pending.batches
    assert seq.take_usual(6, usual) and seq.last == seq.last_live == 6 and len(seq.pending.batches) == 1


def test_a_pod_back_right_after_its_removal_never_resumes_the_generation_the_removal_retired():
    """The sequencing model (seeds 1 and 2 of its first hunt): a pod back just after its grace ended
    resumed its old generation while the ``pod_removed`` was still in flight, or from a batch of it the
    stream stored after the removal (a retry); once applied, the removal retired that generation and the
    pod's batches were dropped as stale. The bridge that removed the pod remembers the removal's mark,
    and any bridge finds it on the stream: neither resumes a generation before it."""
    loop = asyncio.new_event_loop()
    try:
        stream, kv = ModelStream(), MemoryKV()
        bridge = Bridge(stream, kv, 4)
        e = Engine(PODS[0], 0, 100)
        bridge.subscribe(e)
        loop.run_until_complete(bridge.seqs[e.key].on_message(*e.publish([stored([1, 2], block_size=4)])))
        loop.run_until_complete(bridge.quiet())

        def store(entry) -> int:
            seq = stream.store(entry[0], entry[1], entry[2], time.time_ns(), dedupe=False)
            if entry[3] is not None:
                entry[3](seq)
            return seq
        old = list(bridge.flight.pending)
        for entry in old:
            store(entry)
        bridge.flight.pending.clear()
        loop.run_until_complete(bridge.resume.write())
        assert loop.run_until_complete(bridge.l1.last_position(*e.key)) is not None
        bridge.unsubscribe(e.key)
        loop.run_until_complete(bridge.l1.pod_removed(e.pod, "discovery"))  # in flight
        assert loop.run_until_complete(bridge.l1.last_position(*e.key)) is None
        store(bridge.flight.pending.pop())
        store(old[-1])  # the old generation's last batch again, after the removal
        later = Bridge(stream, kv, 4)
        assert loop.run_until_complete(later.l1.last_position(*e.key)) is None
    finally:
        loop.close()


def test_acks_out_of_order_move_the_resume_position_to_the_last_batch_acked_whole():
    """The sequencing model (a flap after a NATS blip): a generation's reset, batch 0 and batch 1 stored
    in the order batch 1, reset, batch 0. The position stopped at the reset (the prefix that batch 0's ack
    completed ends in batch 1, which the stream stored before the reset), so the record named no vLLM
    timestamp and the next subscription started a needless new generation."""
    loop = asyncio.new_event_loop()
    try:
        stream, kv = ModelStream(), MemoryKV()
        bridge = Bridge(stream, kv, 1)
        e = Engine(PODS[0], 0, 100)
        bridge.subscribe(e)
        for _ in range(2):
            loop.run_until_complete(bridge.seqs[e.key].on_message(*e.publish([stored([len(e.buffer)], block_size=4)])))
            loop.run_until_complete(bridge.quiet())
        reset, first, second = bridge.flight.pending
        for subject, data, headers, on_stored, _ in (second, reset, first):
            on_stored(stream.store(subject, data, headers, time.time_ns()))
        loop.run_until_complete(bridge.resume.write())
        row = msgpack.unpackb(kv.data[record_key(e.pod)], strict_map_key=False)["ranks"][0]
        assert row[1] == 1 and row[3] is not None
    finally:
        loop.close()


def test_a_pod_back_before_its_new_generation_is_stored_does_not_resume_the_older_one():
    """The sequencing model: the engine restarted (a new generation, in flight) and the pod flapped
    before NATS stored it; the stream's last message was of the older generation, which the subscription
    resumed: its batches were dropped as stale once the newer reset was stored."""
    m = Sequencing()
    try:
        m.engine_bursts(0, 2)
        m.pod_leaves(0)
        m.pod_returns(0, "quiet")  # a first contact: a new generation, in flight with the first one
        m.stored_late(1, False)  # the first generation's batch 0: the stream's last message of the worker
        m.pod_leaves(0)
        m.pod_returns(0, "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def _removal_entry(e) -> bool:
    return e[2]["Kv-Type"] in ("pod_removed", "rank_removed")


def test_a_batch_of_a_removed_rank_stored_after_its_removal_is_never_resumed():
    """Issue 36 (E): a batch of a DP rank in flight when the rank was unlisted, stored after its
    ``rank_removed`` (a retry), was the rank's last message; the next bridge, with no record of the rank,
    resumed that retired generation when the rank was listed again, and the indexers dropped all it sent
    as stale (the rank blind). The bridge that removed the rank sees the late ack and publishes the removal
    again, after it."""
    m = Sequencing()
    try:
        pod, rank = key = WORKERS[2]
        m.engine_bursts(2, 2)
        m.store_all()
        m.records_written()
        m.engine_publishes(2, "store", 1, True, False)  # in flight when the rank goes
        m.listed[pod].discard(rank)
        m.bridge.unsubscribe(key)
        m.run(m.bridge.l1.rank_removed(pod, rank, "discovery"))
        m._store_now(_removal_entry)
        m.store_all()  # the rank's last batch, after its removal
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)
        m.rank_returns(0, "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_batch_of_a_removed_pod_stored_after_its_purged_removal_is_never_resumed():
    """Issue 36 (F): the same for a pod: its batch stored after its ``pod_removed``, and a purge behind a
    snapshot that took the removal but kept the batch; the next bridge found no removal on the stream and
    resumed the retired generation from the batch."""
    m = Sequencing()
    try:
        m.engine_bursts(0, 2)
        m.store_all()
        m.records_written()
        m.engine_publishes(0, "store", 1, True, False)  # in flight when the pod's grace ends
        m.pod_leaves(0)
        m.grace_ends(0)
        m._store_now(_removal_entry)
        removal = m.stream.last_seq
        m.store_all()  # the pod's last batch, after its removal
        m.apply_stored()
        m.snapshot = (encode_l1(m.state, m.applied), m.applied)
        m.stream.purge(removal + 1)
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)
        m.pod_returns(0, "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_rank_removed_before_its_first_ack_is_not_taken_back_into_the_record():
    """The sequencing model (SEQUENCING_SEED=12): a DP rank listed again (a new generation, its reset and
    batch in flight) and unlisted before the stream acked them. Its record row was dropped, but the acks
    that came after put the rank back into the record (nothing of it had been acked at the removal, so no
    generation was marked forgotten); the next bridge resumed that generation, which the ``rank_removed``
    retired, and the rank stayed blind. Acks of a generation before the removal's mark are ignored."""
    m = Sequencing()
    try:
        m.rank_leaves(0)
        m.rank_returns(0, "raced")
        m.rank_leaves(0)
        m.bridge_replaced(graceful=True, records_first=False, upgrade=False)
        m.snapshot_and_purge(0)
        m.rank_returns(0, "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_pod_that_flaps_before_its_first_record_write_resumes_its_newest_generation():
    """The sequencing model (SEQUENCING_SEED=13): a pod back twice in a row (a first contact each time: a
    new generation each), the older generation's batch stored after the newer one's messages (a retry).
    Back once more before any resume record was written (the first write is asynchronous), the bridge
    resumed from the stream's last message, the older generation's, whose batches the indexers drop as
    stale. The bridge's own acked positions (not written yet) count as its record does."""
    m = Sequencing()
    quiet = m.at_a_quiet_point_the_index_is_the_engines_truth
    try:
        m.pod_leaves(0)  # both pods away (quiet points number the order things are stored in: kept)
        for _ in range(8):
            quiet()
        m.pod_leaves(0)
        quiet()
        quiet()
        m.engine_publishes(0, "store", 1, False, False)
        m.pod_returns(0, "quiet")  # a first contact: a generation
        m.pod_leaves(0)
        m.pod_returns(0, "quiet")  # another (the first not stored yet)
        m.pod_returns(0, "quiet")
        m.stored_late(0, False)
        quiet()  # the older generation's batch stored after the newer one's
        m.pod_leaves(0)
        m.pod_returns(0, "quiet")  # no record written yet
        quiet()
    finally:
        m.loop.close()


def test_a_late_batch_of_a_removed_pod_is_not_resumed_when_its_bridge_died_and_the_removal_was_purged():
    """The sequencing model (CI, SEQUENCING_SEED=1843694871): a pod's batch in flight when it left, its
    removal stored, the batch stored after it (a retry) while the bridge that could have published the
    removal again (it watches for such late acks) was killed; a snapshot then purged the removal. The next
    bridge saw only the retired generation's batch as the subject's last message and resumed it, and the
    indexers dropped every later batch of the pod as stale: its rank stayed empty until the engine
    restarted. The removal's mark now stays in the pod's resume record instead of a deletion."""
    m = Sequencing()
    try:
        m.engine_publishes(i=1, kind="store", live=True, n=1, twice=False)
        m.pod_leaves(p=1)
        m.grace_ends(p=0)
        m.stored_late(dup=False, k=0)  # the reset; then the removal; the batch when the bridge dies
        m.stored_late(dup=False, k=1)
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)
        m.snapshot_and_purge(keep=1)
        m.pod_returns(contact="quiet", p=0)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_removal_stored_after_the_recorded_position_is_a_fresh_start_the_model_allows():
    """The sequencing model (CI, SEQUENCING_SEED=1843694871): a pod back while its removal was in flight,
    a batch of its new generation stored before the removal, an upgrade resuming from the stream, then a
    replacement: the record's position lies before the removal on the stream, which is also what a
    removal re-sent late looks like, so the bridge starts anew. The model counted that as a bridge
    starting over where it could resume."""
    m = Sequencing()
    try:
        for _ in range(7):
            m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.pod_leaves(p=1)
        m.grace_ends(p=0)
        m.engine_restarts(i=0)
        m.engine_bursts(count=2, i=1)
        m.pod_returns(contact="quiet", p=0)
        m.stored_late(dup=False, k=4)
        m.bridge_replaced(graceful=False, records_first=False, upgrade=True)
        m.engine_restarts(i=0)
        m.engine_bursts(count=2, i=0)
        m.bridge_replaced(graceful=True, records_first=False, upgrade=False)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_pod_removed_whose_removal_was_lost_with_the_bridge_comes_back_anew_as_the_model_allows():
    """The sequencing model (CI, SEQUENCING_SEED=2057677783): a pod removed after its grace, its removal
    lost in flight with a killed bridge, the next bridge's records written, and the pod back: its record's
    mark retired the generation, so the bridge starts it anew. The model still counted the workers as
    recorded from before the removal, and took that for a bridge starting over where it could resume."""
    m = Sequencing()
    try:
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.pod_leaves(p=0)
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)
        m.pod_leaves(p=0)
        m.pod_returns(contact="quiet", p=0)
        m.grace_ends(p=0)
        m.bridge_replaced(graceful=False, records_first=True, upgrade=False)
        m.pod_returns(contact="quiet", p=0)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_an_older_generation_left_last_behind_a_purge_is_not_resumed_by_an_upgrade_in_the_model():
    """The spilling model (SEQUENCING_SEED=3783171625, once it stored in-flight batches newest first): a pod
    back within its grace with a new generation while the old one's batches were in flight, those stored
    after the new one's, a purge that kept only the old one's last batch, then an upgrade. That is the
    open window of docs/operations.md (an upgrade resuming the stream's last message, of the retired
    generation); the model keeps upgrades out of it, and now sees it behind a purge too."""
    m = SpillingSequencing()
    try:
        m.engine_bursts(count=2, i=0)
        m.pod_leaves(p=0)
        m.pod_returns(contact="quiet", p=0)
        m.stored_batches_newest_first()
        m.snapshot_and_purge(keep=1)
        m.bridge_replaced(graceful=False, records_first=False, upgrade=True)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_bridge_replaced_while_it_lived_on_never_undoes_a_removal_in_the_records():
    """The chaos soak (sharded, CHAOS_SEED=421964534) in the model: a bridge lost the pod (its shard moved,
    or its lease in a NATS outage) and lived on; the next one removed a DP rank of it (the record kept the
    removal's mark), and a purge took the removal from the stream. The first bridge then wrote its records
    from what it knew: the rank's old position back, the mark gone. The rank listed again under a later
    bridge resumed the retired generation, which the indexers drop as stale: the rank stayed empty. A
    record is written on the revision its writer last saw, else read and merged first. (The model stores a
    lingering bridge's messages at the hand-over and only delays their acks: one of its batches stored after
    the next bridge's messages is tests/test_resume_and_holes.py's.)"""
    m = Sequencing()
    try:
        m.engine_bursts(2, 3)  # WORKERS[2] (10.0.0.2 rank 1): acked to the bridge after it lost the pod
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False, lingering=True)
        m.rank_leaves(1)  # removed by the next bridge
        m.store_all()
        m.snapshot_and_purge(0)
        m.lingering_bridge_writes()
        m.bridge_replaced(graceful=True, records_first=False, upgrade=False)
        m.rank_returns(0, "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_pod_away_when_its_stream_is_lost_never_resumes_a_generation_begun_on_the_lost_stream():
    """A pod away within its grace when the stream was lost, a retry of its batch stored on the new stream
    (its last message there, mid-generation): back, the pod resumed that generation from it, without what
    the generation stored before on the lost stream. The bridge that found the stream lost starts every
    generation begun before anew (``L1Publisher.lost_before``)."""
    m = Sequencing()
    try:
        m.engine_publishes(0, "store", 2, True, False)  # WORKERS[0] (10.0.0.1 rank 0)
        m.store_all()
        m.engine_publishes(0, "store", 1, True, False)  # in flight
        m.pod_leaves(PODS.index("10.0.0.1"))
        m.stream_recreated()
        m.store_all()  # the retry stored on the new stream; its ack tells the bridge
        assert not m.stream_unnoticed
        m.pod_returns(0, "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_an_engine_restarted_while_the_stream_loss_went_unnoticed_leaves_nothing_of_its_old_generation():
    """Found by the model (SEQUENCING_SEED=786611649): batches of an engine in flight when the stream was
    lost were stored on the new stream (mid-generation, without the first); the engine then restarted
    (an empty buffer and cache) before the bridge noticed the loss. Started over, its buffer answered with
    nothing, and a first contact that gets nothing starts its generation at the next live batch: the
    indexers kept the lost generation's remains, blocks the engine no longer held, for as long as it was
    quiet (a pod leaving then kept them through its grace). A start-over whose buffer answers with nothing
    now publishes the reset at once."""
    m = Sequencing()
    try:
        m.at_a_quiet_point_the_index_is_the_engines_truth()  # each engine's first batch stored
        m.engine_bursts(1, 2)  # WORKERS[1] (10.0.0.2 rank 0): two more, in flight
        m.stream_recreated()  # they are stored on the new stream
        m.engine_restarts(1)
        m.bridge_notices_the_new_stream()
        m.pod_leaves(PODS.index("10.0.0.2"))
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_retired_batch_whose_ack_told_of_a_stream_loss_has_its_removal_published_again():
    """Found by the model (SEQUENCING_SEED=8, 1,500 runs; pre-existing): a DP rank listed again and unlisted
    once more, its new generation's batch in flight behind the removal, the stream lost, and that batch
    stored first on the new one. Its ack told the bridge of the loss, and was taken for a batch stored
    before the removal on the same stream (its sequence, 1, below the removal's); the loss then made the
    bridge forget it. Nothing published the removal on the new stream: the removed rank's block stayed
    indexed for good. A retired message acked where the lost stream's removal came after it now has the
    removal published again at the loss."""
    m = Sequencing()
    try:
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.rank_leaves(0)  # WORKERS[1] (10.0.0.2 rank 0)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.rank_returns(0, "quiet")  # a new generation: its reset and batch in flight
        m.rank_leaves(0)  # its removal in flight behind them
        m.stored_late(0, False)  # the reset
        m.stored_late(1, False)  # the removal
        m.engine_publishes(0, "store", 1, False, False)
        m.stream_recreated()
        m.stored_late(0, False)  # the batch, first on the new stream: its ack tells the bridge of the loss
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_generation_begun_at_a_stream_loss_whose_reset_died_with_the_bridge_is_whole_at_the_next():
    """Found by the model (SEQUENCING_SEED=7, 1,500 runs; pre-existing): the bridge noticed a stream loss
    and started its engines over; one engine's reset and first batch were in flight, a later batch stored,
    when the bridge was killed. Its records named the lost stream, so the next bridge resumed from that
    batch and published the engine's buffer up to it again, but the indexers had begun the generation
    there and took the rest for duplicates: 1 block of the engine's 5 indexed. The reset now goes again
    with the buffer (tests/test_resume_and_holes.py has the same with real processes)."""
    m = Sequencing()
    try:
        for _ in range(3):
            m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.rank_leaves(0)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.stream_recreated()
        m.engine_publishes(0, "store", 1, False, False)  # WORKERS[0]: into its buffer alone
        m.bridge_notices_the_new_stream()  # every engine started over: resets and buffers in flight
        m.stored_late(2, False)  # WORKERS[0]'s latest batch, before its reset
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def _a_rank_removed_again_on_a_lost_stream(pods_leave: bool) -> Sequencing:
    """WORKERS[1] (10.0.0.2 rank 0) unlisted; then, the stream lost meanwhile, listed again (a new generation)
    and unlisted once more: the reset and the removal stored on the new stream (the reset's ack tells the
    bridge of the loss), the new generation's batch still in flight. ``pods_leave``: 10.0.0.1 leaves before
    the rank comes back, 10.0.0.2 once it is unlisted again (both away within their grace)."""
    m = Sequencing()
    m.at_a_quiet_point_the_index_is_the_engines_truth()
    m.rank_leaves(0)
    m.at_a_quiet_point_the_index_is_the_engines_truth()
    m.stream_recreated()
    if pods_leave:
        m.pod_leaves(0)  # 10.0.0.1
    m.rank_returns(0, "quiet")  # its reset and batch in flight
    m.rank_leaves(0)  # its removal behind them
    if pods_leave:
        m.pod_leaves(0)  # 10.0.0.2
    m.stored_late(0, False)  # the reset
    m.stored_late(1, False)  # the removal
    return m


def _store_the_first(m: Sequencing, kind: str) -> None:
    """The first message in flight of ``kind`` (``Kv-Type``) stored now."""
    m.stored_late([e[2]["Kv-Type"] for e in m.bridge.flight.pending].index(kind), False)


def test_a_removal_stored_on_a_lost_stream_while_what_it_retired_was_in_flight_outlives_a_killed_bridge():
    """Found by the model (SEQUENCING_SEED=7, 1,500 runs; pre-existing): a DP rank listed again and unlisted
    once more, its removal stored, its new generation's batch still in flight; the stream lost, the bridge
    killed, and that batch stored on the new stream. The removal had been stored, so the targets record no
    longer kept the rank, and the next bridge removed nothing: the removed rank's block stayed indexed.
    A removal stored on a lost stream now stays in the targets record while what it retired is in flight,
    and the next bridge removes the rank again (here once its pod is back)."""
    m = _a_rank_removed_again_on_a_lost_stream(pods_leave=True)
    try:
        m.stream_recreated()
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)  # the batch stored on the new one
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.pod_returns(PODS.index("10.0.0.2"), "quiet")
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_restarted_engines_first_batch_lost_on_the_way_after_a_start_over_is_published():
    """Found by the model (SEQUENCING_SEED=2, 400 runs; pre-existing): an engine restarted while a stream loss
    went unnoticed; started over, its buffer answered with nothing, and the reset went out at the seq after
    the lost generation's last (1). The new process's seq 0 was lost on the way, and its seq 1 came next:
    taken for the next batch of the generation, it was published and 0 never was. A buffer that answers
    with nothing belongs to a process that has published nothing: the generation now starts at seq 0."""
    m = Sequencing()
    try:
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.stream_recreated()
        m.engine_restarts(0)
        m.rank_leaves(0)  # a removal in flight: its ack on the new stream tells the bridge of the loss
        m.time_passes(0)  # started over: WORKERS[0]'s buffer is empty
        m.engine_publishes(0, "store", 1, False, False)  # its seq 0, lost on the way
        m.at_a_quiet_point_the_index_is_the_engines_truth()  # its seq 1 live
    finally:
        m.loop.close()


def test_a_removed_ranks_batch_in_flight_keeps_its_pod_in_the_targets_record_once_the_pod_is_removed_too():
    """Found by review of the fix above: a rank's removal stored, then its pod's, both on a stream lost since,
    the rank's new generation's batch still in flight; the bridge killed, that batch stored on the new
    stream. The batch's ack queue was kept with the rank's removal alone, so the targets record kept the rank
    but not its pod, and the next bridge, which removes a recorded rank only of a pod it lists or inherits,
    removed nothing. The pod's removal now keeps what its ranks' removals retired too."""
    m = _a_rank_removed_again_on_a_lost_stream(pods_leave=True)
    try:
        m.grace_ends(sorted(m.away).index("10.0.0.2"))
        _store_the_first(m, "pod_removed")  # the pod's removal; the batch still in flight
        m.stream_recreated()
        m.bridge_notices_the_new_stream()
        m.bridge_replaced(graceful=False, records_first=False, upgrade=False)  # the batch stored on the new one
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.grace_ends(sorted(m.away).index("10.0.0.2"))
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()


def test_a_removal_published_again_after_a_loss_stays_in_the_targets_record_until_it_is_stored():
    """Found by review: a removal stored on a lost stream, its retired batch then stored on the new one (its
    in-flight queue empty) and the removal published again: until that is stored, the targets record must
    still keep the rank, or a bridge killed meanwhile leaves the batch indexed for good."""
    m = _a_rank_removed_again_on_a_lost_stream(pods_leave=False)
    try:
        m.stream_recreated()
        m.bridge_notices_the_new_stream()
        _store_the_first(m, "batch")  # the retired batch on the new stream: the removal again
        assert any(":removed:after:" in e[2]["Nats-Msg-Id"] for e in m.bridge.flight.pending)
        assert ("10.0.0.2", 0) in m.bridge.l1.unstored_removals()
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        assert ("10.0.0.2", 0) not in m.bridge.l1.unstored_removals()
    finally:
        m.loop.close()


def test_a_reset_published_again_moves_no_resume_position():
    """Found by review: the reset a resuming bridge publishes again (``_rewind_to_tail``) names no vLLM
    timestamp; recorded as the worker's position, a bridge killed before the next write started the worker
    anew. Its ack moves nothing; a generation's first reset still does."""
    loop = asyncio.new_event_loop()
    try:
        bridge = Bridge(ModelStream(), MemoryKV(), 4)
        loop.run_until_complete(bridge.l1.reset("10.0.0.1", 0, 7, 3, "resumed", again=True))
        loop.run_until_complete(bridge.l1.reset("10.0.0.2", 0, 7, 3, "subscribed"))
        for seq, (_, _, _, on_stored, _) in enumerate(bridge.flight.pending, 1):
            on_stored(seq)
        assert bridge.resume.own("10.0.0.1", 0) is None
        assert bridge.resume.own("10.0.0.2", 0) is not None
    finally:
        loop.close()


def test_a_pod_back_with_a_restarted_engine_that_published_nothing_loses_what_a_lost_stream_left_indexed():
    """Found by CI (SEQUENCING_SEED=4246691023; pre-existing): a pod left with a batch in flight, its engine
    restarted while it was away, and the stream was lost; the batch's retry was stored on the new stream, so
    the indexers held it. Back, the pod's generation (begun on the lost stream) was not resumed, and its
    engine's buffer answered with nothing: the bridge waited for a first live batch to start the generation,
    and the stale block stayed indexed, and again once the pod left within its grace. A whole answer with
    nothing now starts the generation at once, with its reset."""
    m = Sequencing()
    try:
        m.at_a_quiet_point_the_index_is_the_engines_truth()
        m.pod_leaves(0)
        m.rank_leaves(0)
        m.pod_returns(0, "queued")  # a batch live at once: in flight when the pod leaves again
        m.pod_leaves(0)
        m.engine_restarts(0)
        m.stream_recreated()
        m.at_a_quiet_point_the_index_is_the_engines_truth()  # the batch stored on the new stream
        m.pod_returns(0, "quiet")
        m.pod_leaves(0)
        m.at_a_quiet_point_the_index_is_the_engines_truth()
    finally:
        m.loop.close()
