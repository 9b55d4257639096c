"""Issue 36 case 3: a nats-server restart under a busy engine must not cost the indexers a batch the
stream holds.

A real nats-server (frozen with SIGSTOP for 0.3 s, killed with SIGKILL, started again 1 s later on the
same JetStream store), a real bridge process with the production publish settings (window 2,048, ack
timeout 5 s), an indexer replica, an engine publishing one-event batches (chains of blocks with their
parents, and evictions) at about 400 a second with a replay buffer far smaller than its history, and an
idle engine holding 200 chains. The publishes in flight when the server died are lost with it; the
stream ends up holding every batch (the bridge publishes them again), so the indexer must end up
holding exactly what each engine holds, without counting a lost gap.

Before the fix the indexer held at most 1,024 early batches per worker while the bridge published the
lost ones again only at their 5 s ack deadline, after some 2,000 later ones: the indexer declared the
gap lost, cleared the busy worker, and the blocks it held before the gap stayed missing for good (here
the bridge also dropped its lease at the first renewal that timed out, resubscribed, and started the
busy engine anew from its replay buffer: two generations in the stream). Now the lease outlives the
restart, the bridge re-sends at the reconnection, and the indexer holds up to twice the publish window.
Since the bridge publishes on a connection of its own that buffers nothing while down
(bridge/stream_connection.py), what it published meanwhile is re-sent with the lost ones, in publish
order, so few batches (here none) arrive early; the read-back of batches past what the indexer holds runs
against a real stream in tests/test_recovery.py.
``CACHE_INDEXER_TEST_SEED`` replays a run's random choices (the seed is printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import msgpack
import pytest
import zmq.asyncio

from cache_indexer.simulate.vllm_engine import VllmPublisher, removed, stored
from cache_indexer.indexer.service import Indexer
from cache_indexer.schemas.events import last_seq
from tests.conftest import make_config, wait_for
from tests.test_local_mode import free_port
from tests.test_recovery import spawn, write_config

BUSY, IDLE = "127.0.0.111", "127.0.0.112"
BS = 16
RATE = 400  # batches a second
BEFORE, TOTAL = 1200, 4400  # batches before the fault, and in all (the fault comes 3 s in, the run lasts 11 s)


def worker_view(indexer: Indexer, pod: str) -> set[int]:
    l1 = indexer.l1
    wid = l1.workers.get(pod, 0)
    return set() if wid is None else {h for h, m in l1.blocks.items() if m >> wid & 1}


class ModelEngine:
    """What an engine holds: chains of blocks, each stored by one event naming its parent, some evicted."""

    def __init__(self, pub: VllmPublisher, rng: random.Random) -> None:
        self.pub, self.rng = pub, rng
        self.chains: list[list[int]] = []
        self.held: set[int] = set()

    def _hash(self) -> int:
        return self.rng.getrandbits(63) | 1

    async def step(self, evict_every: int = 0) -> None:
        live = [c for c in self.chains if c[0] in self.held]
        if evict_every and live and self.rng.randrange(evict_every) == 0:
            chain = self.rng.choice(live)  # eviction goes from the tail of a chain, as vLLM's LRU does
            tail = chain[self.rng.randrange(len(chain)):]
            tail = [h for h in tail if h in self.held]
            if tail:
                self.held -= set(tail)
                await self.pub.publish([removed(tail[::-1])])
                return
        parent = None
        if live and self.rng.random() < 0.5:
            parent = self.rng.choice(live)[-1]  # a prompt that continues a cached prefix
        chain = [self._hash() for _ in range(self.rng.randrange(1, 4))]
        self.chains.append(chain)
        self.held |= set(chain)
        await self.pub.publish([stored(chain, parent=parent, block_size=BS)])


async def busy_loop(engine: ModelEngine, total: int) -> None:
    """``total`` one-event batches at RATE a second (on a schedule: a late turn catches up)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while engine.pub.batches < total:
        due = min(total, int((loop.time() - t0) * RATE) + 1)
        while engine.pub.batches < due:
            await engine.step(evict_every=8)
        await asyncio.sleep(0.005)


async def stream_batch_seqs(js, stream: str, subject: str) -> dict[int, list[int]]:
    """Every vLLM seq the stream holds on ``subject``, per generation (runs counted batch by batch)."""
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
    info = await js.stream_info(stream, subjects_filter=subject)
    out: dict[int, list[int]] = {}
    try:
        for _ in range(info.state.subjects.get(subject, 0) if info.state.subjects else 0):
            m = msgpack.unpackb((await sub.next_msg(10)).data)
            if m["type"] == "batch":
                out.setdefault(m["gen"], []).extend(range(m["seq"], last_seq(m) + 1))
    finally:
        await sub.unsubscribe()
    return out


@pytest.mark.timeout(120)
async def test_a_nats_restart_under_a_busy_engine_loses_nothing_the_stream_holds(restartable_nats, stream_prefix,
                                                                                   tmp_path):
    seed = int(os.environ.get("CACHE_INDEXER_TEST_SEED") or random.randrange(1 << 32))
    print(f"seed {seed} (CACHE_INDEXER_TEST_SEED replays it)")
    rng = random.Random(seed)
    nats_server = restartable_nats
    # production publish and lease settings (the shared test config shortens both)
    cfg = make_config(nats_server.url, stream_prefix,
                      nats={"publish": {"window": 2048, "ackTimeout": "5s"},
                            "lease": {"bucket": f"{stream_prefix}-lease", "ttl": "10s"}})
    ctx = zmq.asyncio.Context()
    busy = ModelEngine(VllmPublisher(ctx, BUSY, 0, 0, buffer_steps=1000), rng)  # far less than its history
    idle = ModelEngine(VllmPublisher(ctx, IDLE, 0, 0, buffer_steps=1000), rng)
    targets = tmp_path / "targets.yaml"
    targets.write_text("vllm:\n" + "".join(f"  - ip: {e.pub.host}\n    zmqPort: {e.pub.pub_port}\n"
                                           f"    replayPort: {e.pub.replay_port}\n" for e in (busy, idle)))
    cfg_file = write_config(cfg, tmp_path / "bridge.yaml", **{"discovery.static.file": str(targets),
                                                              "http.port": free_port(),
                                                              "ingest.l1.blockKeyCheckInterval": 0})
    indexer = Indexer(cfg)
    await indexer.start()
    bridge = spawn("bridge", "--config", str(cfg_file))
    try:
        await busy.pub.wait_subscribed(30)
        await idle.pub.wait_subscribed(30)
        for _ in range(200):
            await idle.step()
        await wait_for(lambda: worker_view(indexer, IDLE) == idle.held, 20, "the idle engine's 200 chains indexed")

        publishing = asyncio.create_task(busy_loop(busy, TOTAL))
        await wait_for(lambda: busy.pub.batches >= BEFORE or publishing.done(), 20, "the busy engine under way")
        proc = nats_server.proc
        proc.send_signal(signal.SIGSTOP)  # the server hangs (its socket buffers fill) ...
        await asyncio.sleep(0.3)
        proc.send_signal(signal.SIGKILL)  # ... and dies with what it had not processed
        await asyncio.to_thread(proc.wait, 10)
        nats_server.proc = None
        await asyncio.sleep(1.0)
        fault_over = time.monotonic()
        await asyncio.to_thread(nats_server.start)  # the same port and store: the stream survives
        await publishing
        print(f"{busy.pub.batches} batches of the busy engine, {len(busy.held)} blocks held at the end")

        async def converged() -> bool:
            return worker_view(indexer, BUSY) == busy.held and worker_view(indexer, IDLE) == idle.held
        try:
            await wait_for(converged, 30, "the index to equal both engines")
            print(f"converged {time.monotonic() - fault_over:.1f}s after the server came back")
        except AssertionError:
            pass  # reported below, with what the stream holds

        name, prefix = cfg.nats.l1Stream.name, cfg.nats.l1Stream.subjectPrefix
        in_stream = await stream_batch_seqs(indexer.js, name, f"{prefix}.{BUSY.replace('.', '_')}.0")
        gens = sorted(in_stream)
        seqs = sorted(set(in_stream[gens[-1]])) if gens else []
        stream_whole = len(gens) == 1 and seqs == list(range(busy.pub.batches))
        lost = indexer.l1.stats.lost_gaps
        view = worker_view(indexer, BUSY)
        missing = [c for c in busy.chains if any(h in busy.held and h not in view for h in c)]
        stats = indexer.l1.stats
        print(f"stream: {len(gens)} generation(s) of the busy engine, {len(seqs)} distinct seqs; indexer: "
              f"{lost} lost gap(s), {stats.early} held early, {stats.spilled} spilled, {stats.read_back} read back, "
              f"{len(missing)} of {len(busy.chains)} chains missing, {len(view - busy.held)} blocks too many")
        assert stream_whole, "the stream holds every batch of the busy engine, in one generation"
        assert lost == 0 and indexer.metrics.ingest_lost_gaps._value.get() == 0, \
            "no gap declared lost while the stream holds every batch"
        assert worker_view(indexer, BUSY) == busy.held, f"{len(missing)} chains of the busy engine missing"
        assert worker_view(indexer, IDLE) == idle.held, "the idle engine's chains"
    finally:
        bridge.kill()
        bridge.wait(10)
        await indexer.stop()
        for e in (busy, idle):
            await e.pub.close()
        ctx.term()


async def test_spilled_batches_are_read_back_from_the_stream_and_a_snapshot_purges_no_further(nats_url, stream_prefix):
    """The read-back against a real stream, message by message: an indexer holding 2 early batches per
    worker gets batches 2..7 before 1 (4..7 are spilled: only their stream sequences are kept); a snapshot
    taken meanwhile (purgeKeep 0) purges the stream up to the first spilled one, not past it; a replica
    started from that snapshot and the one that took it read 4..7 back once 1 comes, and both hold
    every batch, with no gap lost."""
    from cache_indexer.infra.streams import l1_subject

    cfg = make_config(nats_url, stream_prefix, snapshot={"everyMessages": 10**9, "interval": "1h", "purgeKeep": 0})
    pod, name = "10.8.0.1", cfg.nats.l1Stream.name
    indexer, late = Indexer(cfg), None
    indexer.max_early = indexer.l1.max_early = 2
    await indexer.start()
    try:
        js = indexer.js

        async def publish(seq: int) -> int:
            msg = {"type": "batch", "v": 1, "pod": pod, "rank": 0, "gen": 1, "seq": seq, "ts": 0.0,
                   "events": [{"kind": "stored", "hashes": [1000 + seq]}]}
            ack = await js.publish(l1_subject(cfg.nats.l1Stream.subjectPrefix, pod, 0), msgpack.packb(msg), stream=name)
            return ack.seq
        reset = {"type": "reset", "v": 1, "pod": pod, "rank": 0, "gen": 1, "next_seq": 0, "reason": "subscribed"}
        await js.publish(l1_subject(cfg.nats.l1Stream.subjectPrefix, pod, 0), msgpack.packb(reset), stream=name)
        stream_seqs = {seq: await publish(seq) for seq in (0, 2, 3, 4, 5, 6, 7)}
        await indexer.wait_applied(stream_seqs[7], 10)
        assert indexer.l1.spill_floor() == stream_seqs[4] and indexer.l1.stats.spilled == 4
        indexer.lease = None  # this test takes the snapshot itself
        assert await indexer.snapshot_now()
        assert (await js.stream_info(name)).state.first_seq == stream_seqs[4], "purged up to the first spilled one"
        late = Indexer(cfg)
        late.max_early = 2
        await late.start()
        assert late.l1.spill_floor() == stream_seqs[4], "the snapshot says what to read back"
        last = await publish(1)
        for replica in (indexer, late):
            await replica.wait_applied(last, 10)
            wid = replica.l1.workers.get(pod, 0)
            assert {h for h, m in replica.l1.blocks.items() if m >> wid & 1} == {1000 + q for q in range(8)}
            assert replica.l1.stats.lost_gaps == 0 and replica.metrics.ingest_read_back._value.get() == 4
            assert replica.l1.spill_floor() == 0
    finally:
        if late is not None:
            await late.stop()
        await indexer.stop()


@contextlib.asynccontextmanager
async def spilled_batches_4_and_5(cfg, pod: str):
    """An indexer replica holding 2 early batches per worker, fed a reset and batches 0, 2, 3, 4, 5 of
    ``pod`` (4 and 5 spilled, 1 missing); yields it, a publisher of the pod's messages (their stream
    sequence) and the batches' stream sequences."""
    from cache_indexer.infra.streams import l1_subject

    indexer = Indexer(cfg)
    indexer.max_early = indexer.l1.max_early = 2
    await indexer.start()
    try:
        subject, name = l1_subject(cfg.nats.l1Stream.subjectPrefix, pod, 0), cfg.nats.l1Stream.name

        async def publish(msg: dict) -> int:
            return (await indexer.js.publish(subject, msgpack.packb({"v": 1, "pod": pod, "rank": 0, "gen": 1, **msg}),
                                             stream=name)).seq
        await publish({"type": "reset", "next_seq": 0, "reason": "subscribed"})
        at = {seq: await publish({"type": "batch", "seq": seq, "ts": 0.0,
                                  "events": [{"kind": "stored", "hashes": [1000 + seq]}]}) for seq in (0, 2, 3, 4, 5)}
        await indexer.wait_applied(at[5], 10)
        assert indexer.l1.spill_floor() == at[4]
        yield indexer, publish, at
    finally:
        await indexer.stop()


async def test_a_spilled_batch_gone_from_the_stream_is_history_lost_not_a_stall(nats_url, stream_prefix):
    """Retention (or an operator's purge) took a spilled batch before its turn came: counted as history
    lost and as a lost gap, the worker goes on from the next one; the replica neither stalls nor loops."""
    cfg = make_config(nats_url, stream_prefix, snapshot={"enabled": False})
    pod, name = "10.8.0.2", cfg.nats.l1Stream.name
    async with spilled_batches_4_and_5(cfg, pod) as (indexer, publish, at):
        js = indexer.js
        await js.purge_stream(name, seq=at[5])  # batch 4 is gone
        last = await publish({"type": "batch", "seq": 1, "ts": 0.0, "events": [{"kind": "stored", "hashes": [1001]}]})
        await indexer.wait_applied(last, 10)
        wid = indexer.l1.workers.get(pod, 0)
        assert {h for h, m in indexer.l1.blocks.items() if m >> wid & 1} == {1005}, "on from batch 5"
        assert indexer.metrics.history_lost._value.get() == 1 and indexer.metrics.ingest_lost_gaps._value.get() == 1
        assert indexer.metrics.ingest_read_back._value.get() == 1 and indexer.l1.spill_floor() == 0


async def test_a_read_back_cut_off_midway_is_read_back_again_when_the_message_comes_again(nats_url, stream_prefix,
                                                                                           monkeypatch):
    """JetStream does not answer the read-back (a server restarting) until the consumer is made again and the
    handler cut off mid-message: the message that reached the spilled batches comes again, and they are read
    back then. Before, the cursor's entry was taken before the wait: cut off, the spilled batches were never
    read, the worker stalled at them, and nothing was counted."""
    from cache_indexer.infra import ordered_feed

    monkeypatch.setattr(ordered_feed, "HANDLER_GRACE", 0.2)
    cfg = make_config(nats_url, stream_prefix, snapshot={"enabled": False})
    async with spilled_batches_4_and_5(cfg, "10.8.0.3") as (indexer, publish, at):
        pod = "10.8.0.3"
        real_get, asked, answer = indexer.js.get_msg, asyncio.Event(), asyncio.Event()

        async def unanswered_at_first(*args, **kwargs):
            asked.set()
            await answer.wait()  # the first read-back waits here until the handler is cut off
            return await real_get(*args, **kwargs)
        monkeypatch.setattr(indexer.js, "get_msg", unanswered_at_first)
        last = await publish({"type": "batch", "seq": 1, "ts": 0.0, "events": [{"kind": "stored", "hashes": [1001]}]})
        await asyncio.wait_for(asked.wait(), 10)
        restarts = sum(indexer._feed.restarts.values())
        indexer._feed.reconnected()  # the consumer is made again: the handler, still waiting, is cut off

        async def made_again() -> bool:
            return sum(indexer._feed.restarts.values()) > restarts
        await wait_for(made_again, 10, "the consumer made again")
        answer.set()
        await indexer.wait_applied(last, 10)
        wid = indexer.l1.workers.get(pod, 0)
        assert {h for h, m in indexer.l1.blocks.items() if m >> wid & 1} == {1000 + q for q in range(6)}
        assert indexer.metrics.ingest_read_back._value.get() == 2 and indexer.l1.spill_floor() == 0
        assert indexer.l1.stats.lost_gaps == 0 and indexer.metrics.history_lost._value.get() == 0
