"""Issue 15: bridges that scale out (``ingest.sharded``).

Three bridge processes share 12 fake engines on one nats-server; one of them is killed with SIGKILL in
the middle of a burst. Its pods move to the two others within the lease TTL and resume from the stream
(the gap comes from the engines' replay buffers). Afterwards both indexer replicas answer exactly what
the engines hold, and no pod was ever published by two bridges at once (the stream's Kv-Bridge
headers: per pod, a bridge that stopped never comes back).

Placement is rendezvous hashing over bridge names that carry a random part, so with 12 pods over 3
bridges one bridge holds none in about 2% of runs: the test asserts that each bridge holds exactly its
rendezvous share of the pods (read back from the lease bucket), and kills the bridge with the most.
"""

from __future__ import annotations

import asyncio
import random
import signal

import aiohttp
import zmq.asyncio
from nats.js import api

import nats
from cache_indexer.replica import Replica
from cache_indexer.bridge.removals import POD
from cache_indexer.bridge.shard_leases import owner
from tests.conftest import free_port, make_config, metric_value, wait_for
from tests.test_chaos_soak import CHAINS, Engine, answers, holder_pid, shard_leases
from tests.test_recovery import spawn, stop_all, write_config

PODS = [f"127.0.0.{91 + i}" for i in range(12)]


async def _publishers_by_pod(nats_url: str, stream: str) -> dict[str, list[str]]:
    """Per pod, the bridges that published its batches, in stream order (runs collapsed). Resets are left
    out: while the bridges join one by one, each first holder of an idle engine starts its generation
    (reason "idle") and hands it on, which is no batch published after a handover."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        last = (await js.stream_info(stream)).state.last_seq
        sub = await js.subscribe(">", stream=stream, ordered_consumer=True,
                                 config=api.ConsumerConfig(deliver_policy=api.DeliverPolicy.ALL))
        runs: dict[str, list[str]] = {}
        while True:
            msg = await sub.next_msg(timeout=10)
            h = msg.headers or {}
            if "Kv-Bridge" in h and h.get("Kv-Type") == "batch":
                seen = runs.setdefault(h["Kv-Pod"], [])
                if not seen or seen[-1] != h["Kv-Bridge"]:
                    seen.append(h["Kv-Bridge"])
            if msg.metadata.sequence.stream >= last:
                return runs
    finally:
        await nc.close()


async def test_three_sharded_bridges_share_12_engines_and_survive_a_sigkill_mid_burst(nats_url, stream_prefix, tmp_path):
    rng = random.Random(15)
    ctx = zmq.asyncio.Context()
    engines = [Engine(ctx, pod) for pod in PODS]
    targets = tmp_path / "targets.yaml"
    targets.write_text("vllm:\n" + "".join(f"  - ip: {e.pub.host}\n    zmqPort: {e.pub.pub_port}\n"
                                           f"    replayPort: {e.pub.replay_port}\n" for e in engines))
    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"}, ingest={"sharded": True})
    ports = [free_port() for _ in range(3)]
    bridges = [spawn("bridge", "--config", str(write_config(cfg, tmp_path / f"bridge{i}.yaml", **{
        "discovery.static.file": str(targets), "http.port": port}))) for i, port in enumerate(ports)]
    replicas = [Replica(cfg), Replica(cfg)]
    try:
        for r in replicas:
            await r.start()
        async with aiohttp.ClientSession() as session:
            async def shares() -> list[int | None]:
                return [await metric_value(session, p, "cache_indexer_bridge_subscriptions") for p in ports]

            placed: dict[int, int] = {}  # bridge index -> its rendezvous share

            async def spread() -> bool:
                s = await shares()
                members, _ = await shard_leases(nats_url, cfg.nats.lease.bucket)
                if None in s or len(members) != 3:
                    return False
                by_pid = {holder_pid(m): m for m in members}
                if set(by_pid) != {b.pid for b in bridges}:
                    return False
                placed.clear()
                for i, b in enumerate(bridges):
                    placed[i] = sum(owner(POD + p, members) == by_pid[b.pid] for p in PODS)
                return s == [placed[i] for i in range(3)]
            await wait_for(spread, 60, "the 12 engines placed over the 3 bridges by rendezvous hashing")
            print("shares before the kill:", await shares())
            victim = max(range(3), key=lambda i: placed[i])
            survivors = [p for i, p in enumerate(ports) if i != victim]
            for e in engines:
                await e.pub.wait_subscribed(30)

            steps = 1200
            for i in range(steps):
                await rng.choice(engines).step(rng)
                if i % 20 == 0:
                    await asyncio.sleep(0.005)
                if i == steps // 3:
                    bridges[victim].send_signal(signal.SIGKILL)
                    await asyncio.to_thread(bridges[victim].wait, 10)

            async def survivors_cover_all() -> bool:
                s = [await metric_value(session, p, "cache_indexer_bridge_subscriptions") for p in survivors]
                return None not in s and sum(s) == len(PODS)
            await wait_for(survivors_cover_all, 30, "the killed bridge's pods taken over by the two others")

            expected = [[e.expected(chain) for e in engines] for chain in CHAINS]
            for r in replicas:
                port = r.http.port

                async def equal(port=port) -> bool:
                    return await answers(port, PODS) == expected
                await wait_for(equal, 60, f"replica on {port} equal to the engines")

        runs = await _publishers_by_pod(nats_url, cfg.nats.l1Stream.name)
        assert set(runs) == set(PODS)
        for pod, seq in runs.items():
            assert len(seq) == len(set(seq)), f"{pod} was published by a bridge that had handed it over: {seq}"
        published = {holder_pid(b) for seq in runs.values() for b in seq}
        assert {b.pid for i, b in enumerate(bridges) if placed[i]} <= published <= {b.pid for b in bridges}, \
            "every bridge published for its share"
    finally:
        await stop_all(bridges)
        for r in replicas:
            await r.stop()
        for e in engines:
            await e.pub.close()
        ctx.term()


async def test_a_failed_on_owned_is_tried_again_logged_and_counted(nats_url, stream_prefix, caplog):
    """The bridge failing to follow its shards (say EMFILE starting a subscriber) is told again next
    round, on taking and on handing over: it was told once only, and held (renewed) a shard it served not."""
    import logging

    from cache_indexer.bridge.shard_leases import ShardLeases
    from cache_indexer.infra.metrics import Metrics

    nc = await nats.connect(nats_url)
    told: list[set[str]] = []
    fail = [True]

    async def on_owned(owned: set[str]) -> None:
        told.append(set(owned))
        if fail[0]:
            fail[0] = False
            raise RuntimeError("injected: starting a subscriber failed")

    metrics = Metrics()
    errors = metrics.task_errors.labels("shard-leases")
    leases = ShardLeases(nc.jetstream(), f"{stream_prefix}-shards", "bridge-1", 2.0, 1, on_owned, metrics=metrics)
    leases.start()
    try:
        leases.want({"pod:10.0.0.1"})
        await wait_for(lambda: told[-2:] == [{"pod:10.0.0.1"}] * 2, 10, "the failed on_owned made again")
        assert errors._value.get() == 1 and not leases._task.done()
        assert any(r.levelno == logging.ERROR and "injected" in r.getMessage() for r in caplog.records)
        fail[0] = True
        leases.want(set())
        await wait_for(lambda: told[-2:] == [set()] * 2 and not fail[0], 10, "the hand-over made again")
        assert errors._value.get() == 2 and not leases.owned
    finally:
        await leases.stop()
        await nc.close()
