"""Recovery with real processes: indexer replicas killed with SIGKILL and restarted from snapshot +
tail, replicas agreeing, bridges killed mid-burst and resumed from the stream."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import nats
import nats.js.errors
import pytest
import yaml

from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.indexer.service import Indexer
from tests.conftest import make_config, reset_reasons, wait_for
from tests.l1_stack import L1Stack
from tests.test_local_mode import free_port
from cache_indexer.simulate.vllm_engine import removed, stored
from cache_indexer.schemas.events import last_seq

ROOT = Path(__file__).resolve().parents[1]
H = BlockHasher("sha256_cbor", "0")
BS = 4
PODS = ["127.0.0.71", "127.0.0.72", "127.0.0.73"]
DOCS = [[(d * 7919 + i) % 50000 for i in range(BS * 12)] for d in range(8)]
CHAINS = [H.event_hashes(doc, BS) for doc in DOCS]


def write_config(cfg, path: Path, **overrides) -> Path:
    tree = cfg.model_dump(mode="json")  # secrets come out masked: the child process gets them in clear
    tree["http"]["registrationToken"] = cfg.http.registrationToken.get_secret_value()
    tree["nats"]["password"] = cfg.nats.password.get_secret_value()
    tree["nats"]["token"] = cfg.nats.token.get_secret_value()
    for dotted, value in overrides.items():
        node = tree
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    path.write_text(yaml.safe_dump(tree))
    return path


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", *args], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


async def stop_all(procs, timeout: float = 20) -> None:
    """SIGTERM every spawned process still running, then wait for each (off the loop; a process that
    does not stop within ``timeout`` fails the test)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        await asyncio.to_thread(p.wait, timeout)


async def answers(session: aiohttp.ClientSession) -> list:
    out = []
    for doc in DOCS:
        body = {"server_ip": PODS, "body": {"token_ids": doc, "block_size": BS}}
        async with session.post("/kv-cache/hit-rate", json=body) as r:
            assert r.status == 200
            out.append([s["l1_hit_ratio"] for s in (await r.json())["server_score_list"]])
    return out


async def ready(session: aiohttp.ClientSession) -> bool:
    try:
        async with session.get("/readyz") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def burst(engines, rng: random.Random, n: int) -> None:
    """n batches over the engines: stores of document prefixes, some removals."""
    for _ in range(n):
        i = rng.randrange(len(engines))
        chain = CHAINS[rng.randrange(len(CHAINS))]
        if rng.random() < 0.8:
            k = rng.randrange(1, len(chain) + 1)
            await engines[i].publish([stored(chain[:k], block_size=BS)])
        else:
            await engines[i].publish([removed([chain[rng.randrange(len(chain))]])])


def state_view(idx: Indexer) -> dict:
    out = {}
    for (pod, rank), wid in idx.l1.workers.items():
        out[(pod, rank)] = {h for h, m in idx.l1.blocks.items() if m >> wid & 1}
    return out


@pytest.fixture
async def stack(nats_url, stream_prefix):
    cfg = make_config(nats_url, stream_prefix, snapshot={"everyMessages": 40, "interval": "1s", "purgeKeep": 0},
                      blockKey={"pythonHashSeed": "0"})
    s = await L1Stack(cfg).start()
    engines = [s.engine(pod) for pod in PODS]
    await s.connect(*[(e, pod, 0) for e, pod in zip(engines, PODS)])
    yield s, engines
    await s.stop()


async def test_killed_replica_restarts_from_snapshot_and_tail_with_identical_answers(stack, tmp_path):
    s, engines = stack
    rng = random.Random(5)
    port = free_port()
    cfg_file = write_config(s.cfg, tmp_path / "replica.yaml", **{"http.port": port})
    replica = spawn("indexer", "--config", str(cfg_file))
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as other, \
                aiohttp.ClientSession(base_url=f"http://127.0.0.1:{s.replica.http.port}") as ref:
            await wait_for(lambda: ready(other), 30, "second replica ready")
            await burst(engines, rng, 150)
            replica.send_signal(signal.SIGKILL)  # mid-ingest
            replica.wait(10)
            await burst(engines, rng, 150)
            await wait_for(lambda: s.replica.indexer.snapshots_written >= 1, 30, "a snapshot")
            js = s.replica.indexer.js
            info = await js.stream_info(s.cfg.nats.l1Stream.name)
            assert info.state.first_seq > 1, "the stream was compacted behind the snapshot"
            await burst(engines, rng, 30)  # the tail after the snapshot
            replica = spawn("indexer", "--config", str(cfg_file))
            await wait_for(lambda: ready(other), 30, "restarted replica ready")
            await s.replica.indexer.wait_applied(await s.settled(), 20)
            expected = await answers(ref)
            assert any(r > 0 for row in expected for r in row)

            async def same():
                return await answers(other) == expected
            await wait_for(same, 20, "the restarted replica answers like the one that never stopped")
            async with other.get("/metrics") as r:
                text = await r.text()
            assert "cache_indexer_snapshot_loads_total 1.0" in text
    finally:
        replica.kill()
        replica.wait(10)


async def test_three_replicas_agree_including_one_that_started_after_compaction(stack):
    s, engines = stack
    rng = random.Random(9)
    a, b = Indexer(s.cfg), Indexer(s.cfg)
    await a.start()
    await b.start()
    late = None
    try:
        await burst(engines, rng, 120)
        engines[1].restart_engine()  # a reset in the middle
        await burst(engines, rng, 60)
        await wait_for(lambda: s.replica.indexer.snapshots_written >= 1, 30, "a snapshot")
        late = Indexer(s.cfg)
        await late.start()
        await burst(engines, rng, 60)
        last = await s.settled()
        for idx in (s.replica.indexer, a, b, late):
            await idx.wait_applied(last, 20)
        ref = state_view(s.replica.indexer)
        assert ref and all(ref.values())
        assert state_view(a) == ref and state_view(b) == ref and state_view(late) == ref
        assert late.metrics.snapshot_loads._value.get() == 1
    finally:
        for idx in (a, b, late):
            if idx is not None:
                await idx.stop()


async def test_replica_behind_a_purge_reloads_from_the_snapshot(stack):
    s, engines = stack
    rng = random.Random(11)
    lag = Indexer(s.cfg)
    await lag.start()
    try:
        await burst(engines, rng, 20)
        name = s.cfg.nats.l1Stream.name
        last = await s.settled()
        await lag.wait_applied(last, 20)
        await lag._feed.stop()  # this replica stalls ...
        written = s.replica.indexer.snapshots_written
        await burst(engines, rng, 60)
        await wait_for(lambda: s.replica.indexer.snapshots_written > written, 30, "a snapshot and a purge")
        info = await s.replica.indexer.js.stream_info(name)
        assert info.state.first_seq > lag.applied_seq + 1, "what the stalled replica needs next is purged"
        await burst(engines, rng, 10)
        # ... and resumes where it was: its next message is gone, so it reloads from the snapshot
        await lag._feed.start(lag.applied_seq + 1)
        last = await s.settled()
        await lag.wait_applied(last, 20)
        await s.replica.indexer.wait_applied(last, 20)
        assert lag.reloads == 1 and lag.history_lost == 0
        assert state_view(lag) == state_view(s.replica.indexer)
    finally:
        await lag.stop()


async def test_history_lost_to_retention_is_reported(stack):
    s, engines = stack
    await burst(engines, random.Random(3), 50)
    await wait_for(lambda: s.replica.indexer.snapshots_written >= 1, 30, "a snapshot and a purge")
    blind = Indexer(s.cfg.model_copy(update={"snapshot": s.cfg.snapshot.model_copy(update={"enabled": False})}))
    await blind.start()  # cannot read snapshots: the stream alone no longer reaches back to the start
    try:
        assert blind.history_lost == 1
        assert blind.metrics.history_lost._value.get() == 1
    finally:
        await blind.stop()


@pytest.mark.parametrize("buffer_steps,expect_reset", [(10000, False), (5, True)])
async def test_bridge_killed_mid_burst_resumes_from_the_stream(nats_url, stream_prefix, tmp_path, buffer_steps,
                                                               expect_reset):
    cfg = make_config(nats_url, stream_prefix)
    stack = L1Stack(cfg)
    await stack.replica.start()
    engine = stack.engine(PODS[0], buffer_steps=buffer_steps)
    targets = tmp_path / "targets.yaml"
    targets.write_text(f"vllm:\n  - ip: {PODS[0]}\n    zmqPort: {engine.pub_port}\n    replayPort: {engine.replay_port}\n")
    cfg_file = write_config(cfg, tmp_path / "bridge.yaml", **{"discovery.static.file": str(targets),
                                                              "http.port": free_port()})
    bridge = spawn("bridge", "--config", str(cfg_file))
    stored_hashes: list[int] = []
    try:
        await engine.wait_subscribed(30)
        chain = H.event_hashes(list(range(4 * 400)), 4)
        for i in range(100):
            await engine.publish([stored([chain[i]], block_size=4)])
            stored_hashes.append(chain[i])
        await wait_for(lambda: stack.replica.indexer.l1.stats.block_events >= 100, 20, "first part indexed")
        bridge.send_signal(signal.SIGKILL)
        bridge.wait(10)
        for i in range(100, 150):  # published while no bridge listens
            await engine.publish([stored([chain[i]], block_size=4)])
        bridge = spawn("bridge", "--config", str(cfg_file))
        await engine.wait_subscribed(30)
        before = stack.replica.indexer.l1.stats.batches
        await engine.publish([stored([chain[150]], block_size=4)])  # the new bridge sees the gap here
        await wait_for(lambda: stack.replica.indexer.l1.stats.batches > before, 20, "gap handled")
        for i in range(151, 160):
            await engine.publish([stored([chain[i]], block_size=4)])
        js = stack.replica.indexer.js
        name = cfg.nats.l1Stream.name

        async def caught_up():
            info = await js.stream_info(name)
            return stack.replica.indexer.applied_seq == info.state.last_seq and \
                stack.replica.indexer.l1.stats.block_events >= (160 if not expect_reset else 110)
        await wait_for(caught_up, 30, "the new bridge's messages indexed")
        info = await js.stream_info(name)
        msgs = [msgpack.unpackb((await js.get_msg(name, q)).data) for q in range(info.state.first_seq, info.state.last_seq + 1)]
        resets = [m for m in msgs if m["type"] == "reset"]
        wid = stack.replica.indexer.l1.workers.get(PODS[0], 0)
        held = {h for h, m in stack.replica.indexer.l1.blocks.items() if m >> wid & 1}
        if expect_reset:
            assert reset_reasons(r["reason"] for r in resets) == ["subscribed", "gap-beyond-replay"]
            # what the 5-batch buffer held when the new bridge asked (on subscribing: 145..149; or at the gap
            # seq 150 showed, if that came first: 146..150), then the live batches
            start = resets[-1]["next_seq"]
            assert start in (145, 146) and held == set(chain[start:160])
        else:
            assert reset_reasons(r["reason"] for r in resets) == ["subscribed"], "resumed without a reset"
            assert held == set(chain[:160])
            seqs = [s for m in msgs if m["type"] == "batch" for s in range(m["seq"], last_seq(m) + 1)]
            # in order; a batch twice only where the new bridge found no resume record (killed before its
            # first write) and published the engine's buffer up to the stream's last message again
            assert list(dict.fromkeys(seqs)) == list(range(160)), "every batch, in order"
    finally:
        bridge.kill()
        bridge.wait(10)
        await stack.stop()


async def test_readiness_follows_the_nats_connection_after_a_grace(restartable_nats, stream_prefix):
    """Issue 16 #5: /readyz stayed 200 for the whole of a NATS outage (30 s observed), serving stale
    answers. Now it is 503 once the connection has been gone for nats.disconnectGrace, and 200 again
    when it is back; a short reconnection does not take the replica out of the Service."""
    from cache_indexer.replica import Replica

    cfg = make_config(restartable_nats.url, stream_prefix)
    cfg.nats.disconnectGrace = 1.0
    replica = Replica(cfg)
    await replica.start()
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{replica.http.port}") as s:
            async def ready_status() -> int:
                async with s.get("/readyz") as r:
                    return r.status
            await wait_for(lambda: replica.indexer.ready.is_set(), 10, "caught up")
            assert await ready_status() == 200
            restartable_nats.stop()
            await wait_for(lambda: replica.indexer._disconnected_since is not None, 10, "the disconnection seen")
            lost = time.monotonic()
            assert await ready_status() == 200, "within the grace"
            await wait_for(lambda: _is(ready_status, 503), 10, "not ready once the grace is over")
            assert time.monotonic() - lost >= 0.8
            assert replica.metrics.nats_disconnects._value.get() == 1
            restartable_nats.start()
            await wait_for(lambda: _is(ready_status, 200), 20, "ready again once connected")
    finally:
        await replica.stop()


async def _is(status_of, expected: int) -> bool:
    return await status_of() == expected


async def test_a_three_node_cluster_keeps_ingesting_and_restarting_when_a_node_dies(stream_prefix):
    """Issue 16 #3: with jetstream.replicas 3 the streams were R3 but the lease bucket, the meta bucket and
    the snapshot store R1: losing the lease's node stopped all ingestion, losing the store's node made a
    restarting indexer exit 1, and one nats.url could not reach a cluster whose first server was down.
    Every asset now has the configured replicas, and nats.url lists every server."""
    from cache_indexer.replica import Replica
    from cache_indexer.simulate.vllm_engine import stored
    from tests.nats_cluster import NatsCluster
    from tests.test_l1_end_to_end import BS, CHAIN, POD, TOKENS

    cluster = NatsCluster(3).start()
    cfg = make_config(cluster.url, stream_prefix, blockKey={"pythonHashSeed": "0"})
    cfg.nats.replicas = cfg.nats.l1Stream.replicas = cfg.nats.l3Stream.replicas = 3
    stack, fresh = None, None
    try:
        stack = await L1Stack(cfg).start()
        eng = stack.engine(POD)
        await stack.connect((eng, POD, 0))
        await eng.publish([stored(CHAIN[:4])])

        async def ratio(replica) -> float:
            async with aiohttp.ClientSession() as s:
                body = {"server_ip": [POD], "body": {"token_ids": TOKENS, "block_size": BS}}
                async with s.post(f"http://127.0.0.1:{replica.http.port}/kv-cache/hit-rate", json=body) as r:
                    return (await r.json())["server_score_list"][0]["l1_hit_ratio"]
        await wait_for(lambda: _equals(ratio(stack.replica), 0.5), 20, "indexed through the cluster")
        async def snapshot_written() -> bool:  # the indexer's own loop retries too: a bucket just created
            try:                                # in a new cluster may have no route to its leader yet
                return await stack.replica.indexer.snapshot_now()
            except nats.js.errors.NoStreamResponseError:
                return False
        await wait_for(snapshot_written, 30, "a snapshot in the R3 object store")
        js = stack.replica.indexer.js
        for asset in (f"KV_{cfg.nats.lease.bucket}", f"KV_{cfg.snapshot.metaBucket}", f"OBJ_{cfg.snapshot.bucket}"):
            assert (await js.stream_info(asset)).config.num_replicas == 3, asset
        lease_leader = (await js.stream_info(f"KV_{cfg.nats.lease.bucket}")).cluster.leader
        cluster.kill(cluster.index_of(lease_leader))  # the node that led the lease bucket

        async def indexed(expected: float) -> bool:
            # the lease may lapse while the bucket elects a leader (its TTL here is 2 s): the bridge stops
            # its sources then. It must lead again while the node stays down (an R1 lease bucket never
            # did), and take the pod back from its discovery, which here is this test: what the engine
            # published meanwhile comes from its replay buffer.
            if stack.bridge.lease.is_leader and not stack.bridge.subscribers:
                await stack.bridge.set_endpoints([eng.endpoint(POD, 0)])
            return await ratio(stack.replica) == expected

        await eng.publish([stored(CHAIN[4:6], parent=CHAIN[3])])
        await wait_for(lambda: indexed(0.75), 60, "ingestion going on without that node")
        await wait_for(lambda: stack.bridge.lease.is_leader, 30, "the bridge leading without that node")
        await eng.publish([stored(CHAIN[6:8], parent=CHAIN[5])])
        await wait_for(lambda: indexed(1.0), 60, "ingestion after the lease came back")
        fresh = Replica(cfg)  # a replica starting now: snapshot store and streams on the two nodes left
        await fresh.start()
        await wait_for(lambda: fresh.indexer.ready.is_set(), 60, "a new replica ready")
        assert await ratio(fresh) == 1.0
    finally:
        if fresh:
            await fresh.stop()
        if stack:
            await stack.stop()
        cluster.close()


async def _equals(value, expected) -> bool:
    return await value == expected


async def test_a_snapshot_copies_the_tables_off_the_loop_while_queries_are_answered_and_ingest_waits(stack, monkeypatch):
    """While a snapshot copies the tables (held here on its thread until the test lets it go), the replica
    answers queries and applies nothing; then the waiting messages are applied, in order, and the
    snapshot loads to the state it was taken at."""
    import threading

    from cache_indexer.indexer import snapshot as snapshot_module

    s, engines = stack
    rng = random.Random(5)
    await burst(engines, rng, 20)
    indexer = s.replica.indexer
    await indexer.wait_applied(await s.settled(), 20)
    before = state_view(indexer)
    copying, release = threading.Event(), threading.Event()
    export = snapshot_module.L1Snapshot.export

    def held(self):
        copying.set()
        assert release.wait(30)
        return export(self)
    monkeypatch.setattr(indexer, "lease", None)  # this test takes the snapshot itself
    monkeypatch.setattr(snapshot_module.L1Snapshot, "export", held)
    taking = asyncio.create_task(indexer.snapshot_now())
    await wait_for(copying.is_set, 10, "the snapshot to start copying")
    applied = indexer.applied_seq
    await burst(engines, rng, 10)
    last = await s.settled()
    assert await answers(s.session), "queries answered while the tables are copied"
    assert indexer.applied_seq == applied, "nothing applied meanwhile"
    release.set()
    assert await taking
    await indexer.wait_applied(last, 20)
    loaded, seq = snapshot_module.decode_l1(await indexer.snapshots.read((await indexer.snapshots.pointer()).name))
    assert seq == applied
    assert {k: {h for h, m in loaded.blocks.items() if m >> wid & 1} for k, wid in loaded.workers.items()} == before


@pytest.mark.timeout(60)
@pytest.mark.parametrize("paused", ["before-upload", "before-pointer"])
async def test_a_writer_paused_past_its_lease_never_deletes_the_snapshot_the_pointer_names(nats_url, stream_prefix,
                                                                                          paused):
    """Issue 36 #6a: writer A takes a snapshot at stream seq N and is paused (a stopped process, a long GC)
    before its upload or before moving the pointer, past its lease; writer B, now the lease holder, takes
    one at the same seq N, moves the pointer and purges the stream behind it. Both used to write the same
    object name, and A's clean-up after its failed compare-and-set deleted the object the pointer named:
    every later replica start rebuilt from the purged stream (history lost). The pointer's object must
    stand, and a new replica load it."""
    from cache_indexer.infra.streams import l1_subject
    from cache_indexer.infra.tasks import cancel_and_wait

    cfg = make_config(nats_url, stream_prefix, snapshot={"everyMessages": 10**9, "interval": "1h", "purgeKeep": 0})
    subject = l1_subject(cfg.nats.l1Stream.subjectPrefix, "10.9.0.1", 0)
    chain = H.event_hashes(list(range(BS * 40)), BS)
    a, b, late = Indexer(cfg), Indexer(cfg), None
    await a.start()
    try:
        await wait_for(lambda: a.lease.is_leader, 10, "A to hold the snapshot lease")
        await b.start()
        msgs = [{"type": "reset", "v": 1, "pod": "10.9.0.1", "rank": 0, "gen": 1, "next_seq": 0}]
        msgs += [{"type": "batch", "v": 1, "pod": "10.9.0.1", "rank": 0, "gen": 1, "seq": i,
                  "events": [{"kind": "stored", "hashes": chain[i:i + 1], "parent": chain[i - 1] if i else None}]}
                 for i in range(40)]
        for msg in msgs:
            await a.js.publish(subject, msgpack.packb(msg), stream=cfg.nats.l1Stream.name)
        for idx in (a, b):
            await idx.wait_applied(len(msgs), 20)

        # A stops where ``paused`` says, in the middle of its snapshot
        held, go_on = asyncio.Event(), asyncio.Event()
        obs, kv = await a.snapshots._stores()

        class Paused:
            def __init__(self, real, *names: str) -> None:
                self.real, self.names = real, names

            def __getattr__(self, name: str):
                attr = getattr(self.real, name)
                if name not in self.names:
                    return attr

                async def stopped(*args, **kwargs):
                    held.set()
                    await go_on.wait()
                    return await attr(*args, **kwargs)
                return stopped
        wrapped = (Paused(obs, "put"), kv) if paused == "before-upload" else (obs, Paused(kv, "create", "update"))

        async def stores():
            return wrapped
        a.snapshots._stores = stores
        taking = asyncio.create_task(a.snapshot_now())
        await wait_for(held.is_set, 10, "A to stop in the middle of its snapshot")
        await cancel_and_wait(a.lease._task)  # a paused process renews nothing either
        await wait_for(lambda: b.lease.is_leader, 10, "A's lease to expire and B to take it")

        assert await b.snapshot_now(), "B's snapshot at the same seq, the stream purged behind it"
        pointer = await b.snapshots.pointer()
        assert pointer.stream_seq == len(msgs)
        info = await b.js.stream_info(cfg.nats.l1Stream.name)
        assert info.state.first_seq > len(msgs), "the stream was purged behind B's snapshot"

        go_on.set()  # A wakes up, long past its lease
        assert not await asyncio.wait_for(taking, 20), "A's snapshot lost the compare-and-set"
        assert (await b.snapshots.pointer()).name == pointer.name
        assert await obs.get_info(pointer.name), "the object the pointer names is still there"

        late = Indexer(cfg)  # every later replica start loads it, never the purged stream alone
        await late.start()
        assert late.metrics.snapshot_loads._value.get() == 1 and late.history_lost == 0
        assert state_view(late) == state_view(b) and state_view(late)[("10.9.0.1", 0)] == set(chain)
    finally:
        for idx in (late, b, a):
            if idx is not None:
                await idx.stop()


async def test_an_l3_stream_recreated_is_followed_again_after_a_failed_first_consumer(nats_url, stream_prefix,
                                                                                      monkeypatch, caplog):
    """From an independent review: once the L3 stream was recreated, the replica took the new stream for
    followed before its feed started; when making the first consumer failed once (a NATS hiccup), later
    rounds never tried again: no L3 consumer, an empty L3 index, the failure logged at DEBUG only. Now it is
    tried again the next round, and the failure logged and counted."""
    import logging

    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l3_publisher import L3Publisher
    from cache_indexer.indexer import service
    from cache_indexer.infra.metrics import Metrics

    monkeypatch.setattr(service, "TRACK_EVERY", 0.2)
    cfg = make_config(nats_url, stream_prefix, snapshot={"enabled": False})
    name = cfg.nats.l3Stream.name
    indexer = Indexer(cfg)
    await indexer.start()
    try:
        pub = JetStreamPublisher(indexer.nc, Metrics())
        await pub.start()
        l3 = L3Publisher(pub, cfg.nats.l3Stream.subjectPrefix, lambda: 1 << 20, Metrics())
        await l3.full("m1", {"127.0.0.81": [1, 2, 3]})
        await wait_for(lambda: indexer.l3_applied_seq >= 1, 10, "the first L3 message applied")

        feed, failed = indexer._l3_feed, []
        real_start = feed.start

        async def start_failing_once(start_seq=1):
            if not failed:
                failed.append(start_seq)
                raise asyncio.TimeoutError("add_consumer timed out")
            await real_start(start_seq)
        monkeypatch.setattr(feed, "start", start_failing_once)
        await indexer.js.delete_stream(name)  # the replica's lag round makes it again and follows it anew
        await wait_for(lambda: failed, 10, "the new stream's first consumer to fail")
        await l3.full("m1", {"127.0.0.82": [4, 5]})
        assert await pub.flush(10)
        await wait_for(lambda: indexer.l3.pod_workers("127.0.0.82"), 10, "the new L3 stream's state applied")
        await pub.close()
        assert indexer.l3_applied_seq == 1 and indexer._l3_stream_id
        assert indexer.metrics.ingest_consumer_errors.labels(name)._value.get() == 1
        assert indexer.metrics.streams_recreated.labels(name)._value.get() == 1, "counted once, not per try"
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert [m for m in errors if "following it anew failed (add_consumer timed out)" in m]
    finally:
        await indexer.stop()


class _Publisher:
    """L1 messages straight to the stream, as a bridge writes them (one worker)."""

    def __init__(self, js, cfg, pod: str) -> None:
        self.js, self.cfg, self.pod = js, cfg, pod

    async def send(self, msg: dict) -> int:
        from cache_indexer.infra.streams import l1_subject

        subject = l1_subject(self.cfg.nats.l1Stream.subjectPrefix, self.pod, 0)
        body = {"v": 1, "pod": self.pod, "rank": 0, "gen": 1, **msg}
        return (await self.js.publish(subject, msgpack.packb(body), stream=self.cfg.nats.l1Stream.name)).seq

    async def batch(self, seq: int) -> int:
        return await self.send({"type": "batch", "seq": seq, "ts": 0.0,
                                "events": [{"kind": "stored", "hashes": [1000 + seq]}]})

    async def applied(self, indexer: Indexer, batches: int) -> int:
        """A new generation (its reset), then ``batches`` batches, applied by ``indexer``: the last stream seq."""
        await self.send({"type": "reset", "next_seq": 0, "reason": "subscribed"})
        for s in range(batches):
            last = await self.batch(s)
        await indexer.wait_applied(last, 10)
        return last


async def test_early_batches_past_what_the_replica_holds_are_read_back_from_the_stream(nats_url, stream_prefix):
    """A batch stored after many later ones (re-sent at its ack deadline: a message a cluster's leader
    change dropped, a passing refusal) leaves the replica holding ``max_early`` of the later ones in memory
    and the rest only as stream sequences; once the late one comes, those are read back from the real
    stream, one by one, and the worker is whole with no gap declared lost. (tests/test_nats_restart_under_load.py
    ran this against a restarted server until the bridge's re-sends at a reconnection kept publish order.)"""
    cfg = make_config(nats_url, stream_prefix, snapshot={"enabled": False})
    idx = Indexer(cfg)
    idx.max_early = idx.l1.max_early = idx.l1.max_journal = 10
    await idx.start()
    try:
        pub = _Publisher(idx.js, cfg, "10.9.0.4")
        await pub.applied(idx, 1)  # the reset and batch 0
        for seq in range(2, 60):  # 2..11 held, 12..59 spilled
            await pub.batch(seq)
        await wait_for(lambda: idx.l1.stats.spilled == 48, 10, "the batches past the ten held, spilled")
        last = await pub.batch(1)  # the late one
        await wait_for(lambda: idx.applied_seq == last and not idx.l1.read_back_pending(), 10, "read back")
        wid = idx.l1.workers.get("10.9.0.4", 0)
        assert {h for h, m in idx.l1.blocks.items() if m >> wid & 1} == {1000 + s for s in range(60)}
        assert idx.metrics.ingest_read_back._value.get() == 48 and idx.l1.stats.lost_gaps == 0
    finally:
        await idx.stop()


async def test_a_replica_reloaded_onto_a_quiet_stream_is_ready_again(nats_url, stream_prefix, monkeypatch):
    """From a review: a reload (here onto a recreated stream) checked readiness while it still counted as
    reloading, and only a later message checked it again: on a quiet stream the replica, caught up, stayed
    not ready (and took no snapshots) with nothing said."""
    from cache_indexer.indexer import service

    monkeypatch.setattr(service, "TRACK_EVERY", 0.2)
    cfg = make_config(nats_url, stream_prefix, snapshot={"enabled": False})
    idx = Indexer(cfg)
    await idx.start()
    try:
        await _Publisher(idx.js, cfg, "10.9.0.2").applied(idx, 1)
        assert idx.ready.is_set()
        await idx.js.delete_stream(cfg.nats.l1Stream.name)  # lost (an operator, a storage loss)
        await wait_for(lambda: idx.reloads == 1 and not idx._reloading, 10, "the rebuild from the new stream")
        await wait_for(lambda: idx.ready.is_set(), 5, "ready again, nothing to catch up on the new stream")
    finally:
        await idx.stop()


async def test_a_snapshot_this_version_cannot_read_does_not_keep_the_replica_from_starting(nats_url, stream_prefix):
    """From a review: a whole snapshot (its digest right) of a format this version does not know (a newer
    writer's, after a rollback) raised out of the load, and the replica never started. It rebuilds from
    the stream alone, the failure logged and counted, as for a snapshot that cannot be read."""
    from cache_indexer.indexer.l1_state import L1State
    from cache_indexer.indexer.snapshot import SnapshotStore, encode_l1
    from cache_indexer.infra.streams import ensure_l1_stream, records_bucket, stream_id

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    idx = Indexer(cfg)
    try:
        js = nc.jetstream()
        info = await ensure_l1_stream(js, cfg.nats)
        pub = _Publisher(js, cfg, "10.9.0.3")
        await pub.send({"type": "reset", "next_seq": 0, "reason": "subscribed"})
        last = await pub.batch(0)
        blob = encode_l1(L1State(), 0)
        n = int.from_bytes(blob[:8], "little")
        header = msgpack.unpackb(blob[8:8 + n], raw=False, strict_map_key=False)
        header["format"] = "cache-indexer-l1-v99"  # what a later version might write
        head = msgpack.packb(header)
        store = SnapshotStore(js, cfg.snapshot.bucket, records_bucket(cfg))
        assert await store.save(len(head).to_bytes(8, "little") + head + blob[8 + n:], 1, stream_id(info))
        await idx.start()
        await idx.wait_applied(last, 10)
        assert idx.metrics.snapshot_load_failures._value.get() == 1
    finally:
        await idx.stop()
        await nc.close()


async def test_a_snapshot_written_across_a_stream_recreation_is_neither_filed_under_nor_purges_the_new_one(
        nats_url, stream_prefix, monkeypatch):
    """From a review: a snapshot named its stream only once written (seconds of encoding on a large index);
    the stream recreated meanwhile, the old stream's state was filed as the new one's and the new stream
    purged up to the old seq (the engines' resets on it gone). Likewise a writer that had not yet noticed the
    recreation purged the new stream by name."""
    from cache_indexer.indexer import service, snapshot
    from cache_indexer.infra.streams import ensure_l1_stream, stream_id

    monkeypatch.setattr(service, "TRACK_EVERY", 0.2)
    cfg = make_config(nats_url, stream_prefix, snapshot={"everyMessages": 10**9, "interval": "1h", "purgeKeep": 0})
    name = cfg.nats.l1Stream.name
    writer = Indexer(cfg)
    await writer.start()
    try:
        await _Publisher(writer.js, cfg, "10.9.1.1").applied(writer, 8)
        plain = snapshot.L1Snapshot.encode_parts

        def slow_encode(self, exported):  # a large index takes seconds to encode (on a thread)
            time.sleep(2.0)
            return plain(self, exported)
        monkeypatch.setattr(snapshot.L1Snapshot, "encode_parts", slow_encode)
        written = asyncio.create_task(writer.snapshot_now())
        await asyncio.sleep(0.3)
        await writer.js.delete_stream(name)  # lost while the snapshot is encoded
        await wait_for(lambda: writer.reloads == 1 and not writer._reloading, 10, "the rebuild from the new stream")
        await _Publisher(writer.js, cfg, "10.9.1.2").applied(writer, 1)
        assert not await written
        info = await writer.js.stream_info(name)
        pointer = await writer.snapshots.pointer()
        assert pointer is None or pointer.stream_id != stream_id(info), "the old state filed as the new stream's"
        assert info.state.first_seq == 1, "the new stream purged"
        monkeypatch.setattr(snapshot.L1Snapshot, "encode_parts", plain)
        # a writer that has not noticed a recreation yet (its lag round every 10 s) does not purge it either
        monkeypatch.setattr(service, "TRACK_EVERY", 3600)
        await writer.js.delete_stream(name)
        await ensure_l1_stream(writer.js, cfg.nats)
        again = _Publisher(writer.js, cfg, "10.9.1.3")
        first = await again.send({"type": "reset", "next_seq": 0, "reason": "subscribed"})
        await writer.snapshot_now()
        assert (await writer.js.stream_info(name)).state.first_seq == first, "the new stream's reset purged"
    finally:
        await writer.stop()


async def test_a_snapshot_written_while_a_replica_loads_the_one_before_is_loaded_too(nats_url, stream_prefix,
                                                                                     monkeypatch):
    """From a review: a replica loading snapshot S1 while the writer saved S2 and purged behind it found the
    stream starting past S1, declared history lost to retention and jumped: the messages S2 covers were
    never applied. It reads the pointer again and loads S2."""
    from cache_indexer.indexer import snapshot

    cfg = make_config(nats_url, stream_prefix, snapshot={"everyMessages": 10**9, "interval": "1h", "purgeKeep": 0})
    writer = Indexer(cfg)
    await writer.start()
    late = None
    try:
        pub = _Publisher(writer.js, cfg, "10.9.3.1")
        await pub.applied(writer, 4)
        assert await writer.snapshot_now()  # S1
        plain, loaded, go_on = snapshot.SnapshotStore.load, asyncio.Event(), asyncio.Event()

        async def slow_load(self, *a, **kw):  # a large snapshot takes a while to download and decode
            out = await plain(self, *a, **kw)
            loaded.set()
            await go_on.wait()
            return out
        monkeypatch.setattr(snapshot.SnapshotStore, "load", slow_load)
        late = Indexer(cfg)
        starting = asyncio.create_task(late.start())
        await loaded.wait()  # S1 read
        for s in range(4, 8):
            last = await pub.batch(s)
        await writer.wait_applied(last, 10)
        assert await writer.snapshot_now()  # S2, and the purge behind it
        last = await pub.batch(8)
        go_on.set()
        await starting
        await late.wait_applied(last, 10)
        assert late.history_lost == 0, "S2 covers what was purged: no history was lost"
        wid_late, wid_writer = late.l1.workers.get("10.9.3.1", 0), writer.l1.workers.get("10.9.3.1", 0)
        assert {h for h, m in late.l1.blocks.items() if m >> wid_late & 1} == \
            {h for h, m in writer.l1.blocks.items() if m >> wid_writer & 1} == {1000 + s for s in range(9)}
    finally:
        if late is not None:
            await late.stop()
        await writer.stop()


async def test_a_stream_updated_between_two_nats_restarts_is_still_the_one_a_replica_followed(
        restartable_nats, stream_prefix, monkeypatch):
    """From a review: nats-server 2.14 gives a stream a new creation time when it restarts after an update
    made since its previous start (nats-io/nats-server#8470), and replicas told streams apart by creation
    time: after a values change (the update) and two restarts of NATS, every replica took the stream for a
    new one and rebuilt from it alone, its snapshot of another stream now; behind a purge, what the
    snapshot held was gone from the index. A stream is now named by the time its creator wrote into its
    metadata (streams.stream_id), kept across updates."""
    import nats as nats_client

    from cache_indexer.indexer import service
    from cache_indexer.infra.streams import ensure_l1_stream, stream_id

    monkeypatch.setattr(service, "TRACK_EVERY", 0.2)
    srv = restartable_nats
    cfg = make_config(srv.url, stream_prefix, snapshot={"everyMessages": 10**9, "interval": "1h", "purgeKeep": 0})
    name = cfg.nats.l1Stream.name
    idx = Indexer(cfg)
    await idx.start()
    try:
        await _Publisher(idx.js, cfg, "10.9.2.1").applied(idx, 4)
        assert await idx.snapshot_now()
        held = dict(idx.l1.index.blocks)
        assert len(held) == 4 and (await idx.js.stream_info(name)).state.messages == 0, "purged behind the snapshot"
        made = await idx.js.stream_info(name)
        first = stream_id(made)

        async def restarted() -> None:
            srv.stop()
            srv.start()
            await wait_for(lambda: idx.nc.is_connected, 20, "the replica back on NATS")
        await restarted()
        cfg.nats.l1Stream.maxBytes *= 2  # a values change: the next process to start updates the stream
        nc = await nats_client.connect(srv.url)
        try:
            await ensure_l1_stream(nc.jetstream(), cfg.nats)
        finally:
            await nc.close()
        await restarted()
        rounds = idx.metrics.ingest_lag.labels(name)
        rounds.set(-1)
        await wait_for(lambda: rounds._value.get() >= 0 and not idx._reloading, 10, "a round of the replica's check")
        assert idx.metrics.streams_recreated.labels(name)._value.get() == 0, "taken for a new stream"
        blocks = idx.l1.index.blocks
        assert all(blocks.get(h, 0) & m == m for h, m in held.items()), "what the snapshot held"
        info = await idx.js.stream_info(name)
        assert stream_id(info) == first and info.config.max_bytes == cfg.nats.l1Stream.maxBytes
        assert info.created != made.created, "nats-server#8470 no longer reproduces: this tests nothing now"
    finally:
        await idx.stop()


async def test_a_stream_made_before_it_had_a_name_keeps_the_id_replicas_and_records_know_it_by(nats_url,
                                                                                                  stream_prefix):
    """An upgrade: a stream made by an earlier version (no incarnation in its metadata) is known to every
    snapshot and resume record by its creation time; the first process to start names it with that time,
    so nothing takes it for a new one, and the name survives the next update. An earlier version's update
    (a rollback) drops the name, and reads the same id. A stream this version makes is named by its
    creation time too, in the same run of nats-server: what an earlier version reads after a rollback."""
    from cache_indexer.infra.streams import (INCARNATION, ensure_l1_stream, generations_lost_before, stream_config,
                                             stream_id, stream_subjects)

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        legacy = await js.add_stream(stream_config(cfg.nats.l1Stream, stream_subjects(cfg.nats.l1Stream)))
        before = stream_id(legacy)
        assert before == legacy.created.isoformat() and INCARNATION not in (legacy.config.metadata or {})
        named = await ensure_l1_stream(js, cfg.nats)
        assert named.config.metadata[INCARNATION] == before and stream_id(named) == before
        assert generations_lost_before(named) == -1, "an upgrade loses nothing: every generation resumes"
        cfg.nats.l1Stream.maxBytes *= 2
        updated = await ensure_l1_stream(js, cfg.nats)
        assert stream_id(updated) == before and updated.config.max_bytes == cfg.nats.l1Stream.maxBytes
        # an earlier version's update (a rollback) drops the key: the id read then is the same
        old_update = stream_config(cfg.nats.l1Stream, stream_subjects(cfg.nats.l1Stream))
        assert stream_id(await js.update_stream(old_update)) == before
        await js.delete_stream(cfg.nats.l1Stream.name)
        at = time.time_ns()
        made = await ensure_l1_stream(js, cfg.nats)
        assert stream_id(made) == made.created.isoformat() > before, "a new one: named by its creation time"
        # no generation begun before it is resumed on it (a bridge's records of one name the lost stream,
        # but a retry of its batch stored here would be its last message)
        assert at <= generations_lost_before(made) <= time.time_ns()
        cfg.nats.l1Stream.maxBytes *= 2
        assert generations_lost_before(await ensure_l1_stream(js, cfg.nats)) == generations_lost_before(made)
    finally:
        await nc.close()


async def test_a_not_found_that_passes_is_not_a_stream_created_again(nats_url, stream_prefix):
    """From a review: a NotFound that passes (JetStream answering while a cluster elects leaders), the stream
    found on the second look, was reported as created again: a bridge looking at its streams (every 30 s)
    would start every engine over on it, losing what the replay buffers no longer hold."""
    from nats.js.errors import NotFoundError

    from cache_indexer.infra.streams import ensure_again, ensure_l1_stream, stream_id

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        before = await ensure_l1_stream(js, cfg.nats)
        plain, missed = js.stream_info, []

        async def once_not_found(name, *args, **kw):
            if not missed:
                missed.append(name)
                raise NotFoundError()
            return await plain(name, *args, **kw)
        js.stream_info = once_not_found
        info, created = await ensure_again(js, cfg.nats, "l1")
        assert missed and not created and stream_id(info) == stream_id(before)
        await js.delete_stream(cfg.nats.l1Stream.name)
        info, created = await ensure_again(js, cfg.nats, "l1")
        assert created and stream_id(info) != stream_id(before)
    finally:
        await nc.close()


async def test_an_update_of_a_stream_keeps_a_name_it_was_given_since_the_process_read_it(nats_url, stream_prefix):
    """From a review: a process starting with changed limits read the stream, a bridge then named the
    stream anew (it had lost its messages), and the update, made from what was read before, wrote the old
    name back: replicas took it for the lost stream again and could load its snapshot. The update is made
    from the stream as it is just before."""
    import nats as nats_client

    from cache_indexer.infra.streams import ensure_l1_stream, name_anew, stream_id

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats_client.connect(nats_url)
    try:
        js = nc.jetstream()
        first = stream_id(await ensure_l1_stream(js, cfg.nats))
        renamed: list[str] = []

        class NamedAnewOnceRead:
            """``js``, where another bridge names the stream anew right after this process's first read."""

            def __getattr__(self, attr):
                return getattr(js, attr)

            async def stream_info(self, name, *a, **kw):
                info = await js.stream_info(name, *a, **kw)
                if not renamed:
                    renamed.append(stream_id(await name_anew(js, info)))
                return info
        cfg.nats.l1Stream.maxBytes *= 2  # so the starting process updates the stream
        info = await ensure_l1_stream(NamedAnewOnceRead(), cfg.nats)
        assert renamed and renamed[0] > first
        assert stream_id(info) == stream_id(await js.stream_info(cfg.nats.l1Stream.name)) == renamed[0]
        assert info.config.max_bytes == cfg.nats.l1Stream.maxBytes
    finally:
        await nc.close()


async def test_two_bridges_naming_one_loss_at_once_give_it_one_name(nats_url, stream_prefix):
    """From a review: sharded bridges all see the acks of a stream that lost its messages go back, within
    milliseconds; each named it by its own clock, the later name replaced the first, and the first bridge
    took that for another loss (its engines started over twice, replicas rebuilt twice). The new name
    depends on the old one alone."""
    import nats as nats_client

    from cache_indexer.infra.streams import ensure_l1_stream, name_anew, stream_id

    cfg = make_config(nats_url, stream_prefix)
    nc = await nats_client.connect(nats_url)
    try:
        js = nc.jetstream()
        before = await ensure_l1_stream(js, cfg.nats)

        class ReadBeforeTheOtherWrote:
            def __getattr__(self, attr):
                return getattr(js, attr)

            async def stream_info(self, name, *a, **kw):
                return before
        first = await name_anew(js, before)
        second = await name_anew(ReadBeforeTheOtherWrote(), before)
        now = await js.stream_info(cfg.nats.l1Stream.name)
        assert stream_id(first) == stream_id(second) == stream_id(now) > stream_id(before)
    finally:
        await nc.close()
