"""Model-based tests of the L1 sequencing (issue 24): the bridge's sequencer and the indexer's cursor,
driven through arbitrary interleavings against a reference model of what the engines hold.

The product's own decision code runs: bridge/l1_sequencer.py, bridge/l1_publisher.py with its resume
points (bridge/resume_points.py), indexer/l1_state.py and the snapshot encoding. Only the I/O around
them is modelled: JetStream (stored in order, ``Nats-Msg-Id`` deduplicated, purged behind snapshots),
the bridge's publisher (a message stays in flight until the model stores it, in any order; a crash loses
what is in flight), the KV bucket, and vLLM engines (seq from 0, a replay buffer of bounded size, a
restart empties both). Steps: engines publish (stores of new chains, evictions, AllBlocksCleared; live
or lost on the way), engines restart, in-flight messages are stored late, out of order, or again past
the duplicate window, the bridge is killed (in-flight messages and unwritten resume records lost) or
stopped gracefully and replaced, resume records are written, snapshots are taken and the stream purged
behind them, the indexer restarts from the snapshot, time passes.

At every quiet point (everything in flight stored, everything applied): with replay buffers larger than
the run, the index equals what each engine holds, and no generation was started but for an engine
restart; with small buffers (history truly lost), the index never holds a block the engine does not
(ratios may be low, never too high).

A failure prints its steps and a ``@reproduce_failure`` blob that replays it exactly;
``pytest --hypothesis-seed=N`` replays a whole run.
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
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from nats.js.errors import KeyNotFoundError, NotFoundError

from bridge.endpoint import Endpoint
from bridge.l1_publisher import L1Publisher
from bridge.l1_sequencer import L1Sequencer, Replayed
from bridge.receive_budget import ReceiveBudget
from bridge.resume_points import KEY_PREFIX, ResumePoints, record_key
from infra.metrics import Metrics
from cache_indexer.simulate.vllm_engine import batch_payload, cleared, removed, stored
from indexer.l1_state import L1State
from indexer.snapshot import decode_l1, encode_l1

STREAM, PREFIX = "KV_L1", "kvcache.l1"
PODS = ["10.0.0.1", "10.0.0.2"]


class ModelStream:
    """JetStream as the bridge and the indexers use it."""

    def __init__(self) -> None:
        self.msgs: dict[int, SimpleNamespace] = {}
        self.last_seq = 0
        self.first_seq = 1
        self.ids: dict[str, int] = {}  # Nats-Msg-Id -> stream seq, within the duplicate window

    def store(self, subject: str, data: bytes, headers: dict, now: int, dedupe: bool = True) -> int:
        msg_id = headers.get("Nats-Msg-Id")
        if dedupe and msg_id in self.ids:
            return self.ids[msg_id]
        self.last_seq += 1
        self.msgs[self.last_seq] = SimpleNamespace(seq=self.last_seq, subject=subject, data=data, headers=dict(headers),
                                                   stored_ns=now)
        self.ids[msg_id] = self.last_seq
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
    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    async def get(self, key: str):
        if key not in self.data:
            raise KeyNotFoundError()
        return SimpleNamespace(value=self.data[key])

    async def put(self, key: str, value: bytes) -> None:
        self.data[key] = value

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)


class Engine:
    """A vLLM engine: what it holds (a multiset: one hash can be cached in two blocks), its seq and its
    replay buffer."""

    def __init__(self, pod: str, buffer: int) -> None:
        self.pod = pod
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.held: Counter[int] = Counter()
        self.ts = itertools.count(1)

    def publish(self, events: list[dict]) -> tuple[int, bytes]:
        seq, self.seq = self.seq, self.seq + 1
        payload = batch_payload(events, ts=float(next(self.ts)) + self.seq / 1e6)
        self.buffer.append((seq, payload))
        return seq, payload

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()
        self.held.clear()

    def holds(self) -> set[int]:
        return {h for h, n in self.held.items() if n}


class Bridge:
    """One bridge incarnation: an L1 publisher with resume points and a sequencer per engine."""

    def __init__(self, stream: ModelStream, kv: MemoryKV, engines: list[Engine], max_batches: int) -> None:
        self.flight = InFlight()
        self.resume = ResumePoints(None, "meta")
        self.resume._store._kv = kv
        self.resume.stream_id = "s"
        self.l1 = L1Publisher(self.flight, PREFIX, stream, STREAM, lambda: 1 << 20, "model", self.resume)
        self.metrics = Metrics()
        budget = ReceiveBudget(1 << 40)
        self.seqs: dict[str, L1Sequencer] = {}
        for e in engines:
            async def replay(start: int, empty_is_failure: bool, e=e) -> Replayed:
                return Replayed(budget, [b for b in e.buffer if b[0] >= start], complete=True)
            ep = Endpoint(e.pod, 0, f"tcp://{e.pod}:5557", f"tcp://{e.pod}:5567")
            seq = self.seqs[e.pod] = L1Sequencer(ep, self.l1, self.metrics, replay, max_batches, 1 << 20)
            self.l1.watch_refusals(e.pod, 0, seq.refused)

    async def resume_all(self) -> None:
        for pod, seq in self.seqs.items():
            seq.resume(await self.l1.last_position(pod, 0))
            await seq.catch_up()

    async def quiet(self) -> None:
        """What the subscriber's loop does between bursts: refusals handled, runs published."""
        for seq in self.seqs.values():
            if seq.refused_upto is not None:
                await seq.after_refusal()
            await seq.flush()

    def resets(self) -> dict[str, float]:
        return {s.labels["reason"]: s.value for s in self.metrics.bridge_resets.collect()[0].samples
                if s.name.endswith("_total") and s.value}


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
        self.engines = [Engine(pod, self.buffer) for pod in PODS]
        self.usual_path = {PODS[0]}  # the first engine's batches go as the subscriber hands them on
        self.now = time.time_ns()  # generations are the bridge's wall clock: the stream's must agree
        self.bridge = Bridge(self.stream, self.kv, self.engines, 4)
        self.state = L1State(self.max_early, self.max_journal)
        self.applied = 0
        self.snapshot: tuple[bytes, int] | None = None
        self.resets: Counter[str] = Counter()  # of the bridges replaced
        #: subscriptions that may start a generation: the first, and a new bridge's where neither a resume
        #: record nor the stream still says where the engine stands (records not written yet, purged)
        self.fresh_starts = len(PODS)
        #: pods the current bridge resumed from a position it could check, and a records write since: a new
        #: bridge can resume them even once the stream's messages are purged (judged by the model, as the
        #: code's own records are what is tested); both forget a pod when its engine publishes or restarts.
        #: A pod whose engine restarted since it last published is not resumed but started anew.
        self.resumed: set[str] = set()
        self.recorded: set[str] = set()
        self.restarted: set[str] = set()
        self.chains = itertools.count(1)
        self.quiet_points = 0

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    # -- engines -------------------------------------------------------------------------------------
    @rule(i=st.integers(0, 1), kind=st.sampled_from(["store", "store", "store", "evict", "clear"]),
          n=st.integers(1, 4), live=st.booleans(), twice=st.booleans())
    def engine_publishes(self, i, kind, n, live, twice):
        e = self.engines[i]
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
            return
        self.resumed.discard(e.pod)
        self.recorded.discard(e.pod)
        if live:  # the bridge sees the restart (a new generation) only in a batch of the new process
            self.restarted.discard(e.pod)
        seq, payload = e.publish(events)
        if live:  # else lost on the way (a ZMQ drop): a gap the next live batch shows
            sequencer = self.bridge.seqs[e.pod]
            # as the subscriber hands a batch on: the path without a coroutine where it takes the batch
            # (the usual one), else on_message; every other chain takes on_message alone
            if e.pod in self.usual_path and sequencer.take_usual(seq, payload):
                if sequencer.pending.full():
                    self.run(sequencer.flush())
            else:
                self.run(sequencer.on_message(seq, payload))
            self.run(self.bridge.quiet())

    @rule(i=st.integers(0, 1), count=st.integers(2, 6))
    def engine_bursts(self, i, count):
        """Several batches in a row: more than one message of a worker in flight at once."""
        for _ in range(count):
            self.engine_publishes(i, "store", 1, True, False)

    @rule(i=st.integers(0, 1))
    def engine_restarts(self, i):
        """A new engine process: seq from 0, an empty buffer and cache, and a new TCP connection, which
        the subscriber's socket monitor reports (the sequencer then checks the next batch's incarnation)."""
        self.engines[i].restart()
        self.resumed.discard(self.engines[i].pod)
        self.recorded.discard(self.engines[i].pod)
        self.restarted.add(self.engines[i].pod)
        self.bridge.seqs[self.engines[i].pod].reconnected = True

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
        self.run(self.bridge.quiet())

    @precondition(lambda self: self.refusals and self.bridge.flight.pending)
    @rule(k=st.integers(0, 10**6))
    def refused(self, k):
        _, _, headers, _, on_refused = self.bridge.flight.pending.pop(k % len(self.bridge.flight.pending))
        if on_refused is not None and headers["Kv-Type"] == "batch":
            on_refused()
        self.run(self.bridge.quiet())

    def store_all(self, rng: random.Random | None = None) -> None:
        while self.bridge.flight.pending:
            self.stored_late(rng.randrange(1 << 20) if rng else 0, False)

    # -- the bridge ----------------------------------------------------------------------------------
    @rule()
    def records_written(self):
        """A write of the resume records: a pod resumed from the stream's last message is recorded once
        the buffer published again up to it is stored (its acks move the position)."""
        self.run(self.bridge.resume.write())
        in_flight = {e[2]["Kv-Pod"] for e in self.bridge.flight.pending}
        self.recorded |= self.resumed - in_flight

    @rule(graceful=st.booleans(), records_first=st.booleans(), upgrade=st.booleans())
    def bridge_replaced(self, graceful, records_first, upgrade):
        """kill -9 (what is in flight, and resume points not written yet, are lost; maybe right after a
        write of them), or SIGTERM or a standby taking over after a clean stop. ``upgrade``: the bridge
        replaced is a version from before the resume records (it kept none), stopped by the rolling update,
        so the new one resumes every pod from the stream's last message, and publishes the engine's buffer
        up to it again."""
        # Open (docs/operations.md, recovery; found by a 1,500-run hunt): after the stream refused a message, a new
        # generation began while older ones of the old generation were still in flight; one stored after
        # the new reset is the subject's last message, and a bridge with no record (an upgrade) resumes
        # that old generation, whose batches the indexers then drop as stale. Upgrades are drawn only
        # where nothing is refused.
        upgrade = upgrade and not self.refusals
        graceful = graceful or upgrade
        if records_first:
            self.records_written()
        if not graceful:
            # The one window left open (docs/operations.md, recovery): a bridge killed while a new generation's reset
            # is in flight and a later batch of it was stored (out of order) leaves that generation
            # without its reset; the next bridge resumes it from the stream. The model kills bridges
            # outside it: a generation not yet recorded has its messages in flight stored first.
            resume = self.bridge.resume
            new_pods = {seq.ep.pod for seq in self.bridge.seqs.values()
                        if seq.gen is not None and record_key(seq.ep.pod) not in self.kv.data}
            if new_pods:
                for entry in [e for e in self.bridge.flight.pending if e[2]["Kv-Pod"] in new_pods]:
                    self.bridge.flight.pending.remove(entry)
                    seq = self.stream.store(entry[0], entry[1], entry[2], self.now)
                    if entry[3] is not None:
                        entry[3](seq)
                later, resume._dirty = resume._dirty - new_pods, resume._dirty & new_pods
                self.run(resume.write())
                resume._dirty |= later
        if graceful:
            self.run(self.bridge.quiet())
            self.store_all()
            self.records_written()
        if upgrade:
            self.kv.data = {k: v for k, v in self.kv.data.items() if not k.startswith(KEY_PREFIX)}
            self.recorded.clear()
        self.resets.update(self.bridge.resets())
        old = self.bridge
        self.bridge = Bridge(self.stream, self.kv, self.engines, old.seqs[PODS[0]].pending.max_batches)
        for pod, seq in old.seqs.items():  # judged from the model's own KV and stream, not the code's
            if seq.gen is not None and not self.checkable_position(pod) and pod not in self.recorded:
                self.fresh_starts += 1
        self.resumed = {pod for pod in PODS if (self.checkable_position(pod) or pod in self.recorded)
                        and pod not in self.restarted}
        self.run(self.bridge.resume_all())
        self.run(self.bridge.quiet())

    def checkable_position(self, pod: str) -> bool:
        """Whether a new bridge can know where the engine stands, and check it is the same engine process:
        its resume record (or its last stream message, where that is of a newer generation) names a batch
        with vLLM's timestamp (a reset names none: a new generation then starts from the engine's buffer)."""
        subject = f"{PREFIX}.{pod.replace('.', '_')}.0"
        last = max((m for m in self.stream.msgs.values() if m.subject == subject), key=lambda m: m.seq, default=None)
        record = self.kv.data.get(record_key(pod))
        row = msgpack.unpackb(record, strict_map_key=False)["ranks"][0] if record else None
        if row is not None:
            if last is not None and int(last.headers["Kv-Gen"]) > row[0]:
                return False  # a generation younger than the record: started anew
            return row[3] is not None
        return last is not None and last.headers["Kv-Type"] == "batch"

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

    def read_back(self, upto: int) -> None:
        """What the service does after each message: a spilled message a worker's cursor reached is read
        back from the stream by its stream sequence, until none is due."""
        while (due := self.state.read_back_due()) is not None:
            (pod, rank), at = due
            assert self.stream.first_seq <= at < upto, "purged past what a worker has to read back"
            m = self.stream.msgs[at]
            assert m.subject == f"{PREFIX}.{pod.replace('.', '_')}.{rank}"
            self.state.apply(msgpack.unpackb(m.data, raw=False), m.stored_ns, at, read_back=True)

    @rule(keep=st.integers(0, 5))
    def snapshot_and_purge(self, keep):
        self.apply_stored()
        if not self.applied:
            return
        self.snapshot = (encode_l1(self.state, self.applied), self.applied)
        floor = self.state.spill_floor()  # as the service purges: never past what is to be read back
        self.stream.purge(min(self.applied + 1 - keep, floor) if floor else self.applied + 1 - keep)

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
        """A quiet point: each engine's latest batch arrives live (one lost on the way with nothing after
        it cannot be seen by anyone until the engine publishes again), everything in flight is stored,
        everything stored is applied."""
        self.quiet_points += 1
        rng = random.Random(self.quiet_points)  # the order things are stored in: replayable
        for i in range(len(self.engines)):
            self.engine_publishes(i, "store", 1, True, False)
        self.store_all(rng)
        self.apply_stored()
        for e in self.engines:
            wid = self.state.workers.get(e.pod, 0)
            index = set() if wid is None else {h for h, m in self.state.blocks.items() if m >> wid & 1}
            if self.buffer >= 100000 and not self.refusals:
                assert index == e.holds(), f"{e.pod}: index {sorted(index)} != engine {sorted(e.holds())}"
            else:
                assert index <= e.holds(), f"{e.pod}: index holds {sorted(index - e.holds())} the engine does not"
        resets = self.resets + Counter(self.bridge.resets())
        if self.buffer >= 100000 and not self.refusals:
            unexpected = {r: n for r, n in resets.items() if r not in ("subscribed", "engine-restart")}
            assert not unexpected, f"generations started without need: {unexpected}"
            assert resets["subscribed"] <= self.fresh_starts, "a bridge started over where it could resume"


#: runs of 40 steps each (``SEQUENCING_EXAMPLES=2000 pytest --timeout=0 ...`` for a longer hunt)
EXAMPLES = int(os.environ.get("SEQUENCING_EXAMPLES", "300"))
Sequencing.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None, print_blob=True,
                                        suppress_health_check=list(HealthCheck))
test_the_sequencing_keeps_the_index_equal_to_the_engines = Sequencing.TestCase


class LossySequencing(Sequencing):
    """Replay buffers of 3 batches and refused messages: history is lost, ratios may only be too low."""
    buffer = 3
    refusals = True


LossySequencing.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None, print_blob=True,
                                             suppress_health_check=list(HealthCheck))
test_with_history_lost_the_index_never_holds_what_the_engine_does_not = LossySequencing.TestCase


class SpillingSequencing(Sequencing):
    """An indexer that holds one early message per worker: the rest is spilled and read back from the
    stream (issue 36 #3); the index must still equal the engines at every quiet point, with no gap lost.
    (The journal of a generation stored before its reset keeps its own bound: it is not read back.)"""
    max_early = 1

    def at_a_quiet_point_the_index_is_the_engines_truth(self):
        super().at_a_quiet_point_the_index_is_the_engines_truth()
        assert not self.state.stats.lost_gaps, "a gap declared lost while the stream holds every batch"


SpillingSequencing.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                                print_blob=True, suppress_health_check=list(HealthCheck))
test_an_indexer_that_spills_early_batches_keeps_the_index_equal_to_the_engines = SpillingSequencing.TestCase


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
