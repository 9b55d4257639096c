"""Issue 36: with sharded bridges, a removal cannot be skipped by the death of the bridge that owns it.

Three bridge processes (``ingest.sharded``) share 8 fake engines (vLLM's frames) and 8 fake Mooncake
masters, listed in one static targets file. The bridge that owns a pod P and a master M (its shard
leases in the lease bucket name its pid) is killed with SIGKILL, or stopped with SIGTERM, and at the
same moment P and M are taken out of the targets file. The removal grace (0.3 s) ends long before the
victim's membership and leases run out (the lease TTL is 2 s): the two others must still announce P's
removal and M's empty state, once the victim's leases are gone. The indexer (a replica in this process)
then answers 0 for P's chains and holds nothing of M, and every other pod is exactly what its engine
holds (the victim's other pods moved and resumed from the stream)."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import aiohttp
import nats
import pytest
import yaml
import zmq.asyncio
from nats.js.errors import NotFoundError

from cache_indexer.replica import Replica
from cache_indexer.infra.streams import subject_token
from tests.conftest import free_port, make_config, metric_value, wait_for
from tests.test_chaos_soak import CHAINS, Engine, answers, holder_pid, shard_leases
from tests.test_mooncake import FakeMaster, key, l3_held
from tests.test_recovery import spawn, stop_all, write_config

PODS = [f"127.0.0.{111 + i}" for i in range(8)]
MASTERS = [f"m{i}" for i in range(8)]
L3_POD = {m: f"127.0.1.{10 + i}" for i, m in enumerate(MASTERS)}  # the one pod each master reports
#: From the kill to the index without P and M: the lease TTL (2 s) for the victim's leases to run out, a
#: lease round, the survivors' check of the stream; the rest is room for two shared cores.
REMOVED_WITHIN = 20.0


def _targets(engines: list[Engine], masters: dict[str, FakeMaster]) -> str:
    return yaml.safe_dump({
        "vllm": [{"ip": e.pub.host, "zmqPort": e.pub.pub_port, "replayPort": e.pub.replay_port} for e in engines],
        "mooncakeMasters": [{"host": "127.0.0.1", "httpPort": int(m.url.rsplit(":", 1)[1]), "name": name}
                            for name, m in masters.items()]})


async def _leases(nats_url: str, bucket: str) -> tuple[int, dict[str, int]]:
    """(the bridges that are members, shard lease -> the pid of the bridge holding it)."""
    members, holders = await shard_leases(nats_url, bucket)
    return len(members), {shard: holder_pid(holder) for shard, holder in holders.items()}


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_a_pod_and_a_master_removed_while_their_bridge_dies_are_still_removed(nats_url, stream_prefix, tmp_path,
                                                                                   how):
    rng = random.Random(36)
    ctx = zmq.asyncio.Context()
    engines = [Engine(ctx, pod) for pod in PODS]
    masters = {}
    for i, name in enumerate(MASTERS):
        m = masters[name] = await FakeMaster().start()
        m.segments = [f"{L3_POD[name]}:12001"]
        m.keys = {key(100 + i): [f"{L3_POD[name]}:16001"]}
    targets = tmp_path / "targets.yaml"
    targets.write_text(_targets(engines, masters))
    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"},
                      ingest={"sharded": True, "l1": {"removalGrace": "300ms"}, "l3": {"pollInterval": "300ms"}},
                      discovery={"refreshInterval": "200ms"})
    ports = [free_port() for _ in range(3)]
    bridges = [spawn("bridge", "--config", str(write_config(cfg, tmp_path / f"bridge{i}.yaml", **{
        "discovery.static.file": str(targets), "http.port": port}))) for i, port in enumerate(ports)]
    replica = Replica(cfg)
    try:
        await replica.start()
        async with aiohttp.ClientSession() as session:
            async def spread() -> bool:
                s = [await metric_value(session, p, "cache_indexer_bridge_subscriptions") for p in ports]
                return None not in s and sum(s) == len(PODS)
            await wait_for(spread, 60, "the 8 engines subscribed by the 3 bridges")
        for e in engines:
            await e.pub.wait_subscribed(30)
        for i, e in enumerate(engines):
            for chain in CHAINS[i % 3::3]:
                await e.store_chain(chain[:rng.randrange(3, len(chain) + 1)])

        async def indexed() -> bool:
            return (await answers(replica.http.port, PODS) == [[e.expected(c) for e in engines] for c in CHAINS]
                    and all(l3_held(replica.indexer.l3, L3_POD[m]) == {100 + i} for i, m in enumerate(MASTERS)))
        await wait_for(indexed, 30, "every engine and master indexed")

        shards = {subject_token("pod:" + p) for p in PODS} | {subject_token("master:" + m) for m in MASTERS}
        seen: list[dict[str, int]] = [{}]

        async def placed() -> bool:  # every shard held, the same way a lease round apart, by 3 members
            members, owners = await _leases(nats_url, cfg.nats.lease.bucket)
            stable = members == 3 and set(owners) == shards and owners == seen[-1]
            seen.append(owners)
            await asyncio.sleep(cfg.nats.lease.ttl / 2)
            return stable
        await wait_for(placed, 30, "every pod and master placed over the 3 bridges")
        owners = seen[-1]
        victim = pod = master = None
        for b in bridges:
            pods = [p for p in PODS if owners.get(subject_token("pod:" + p)) == b.pid]
            ms = [m for m in MASTERS if owners.get(subject_token("master:" + m)) == b.pid]
            if pods and ms:
                victim, pod, master = b, pods[0], ms[0]
                break
        assert victim is not None, f"no bridge owns both a pod and a master: {owners}"
        print(f"victim pid {victim.pid} owns {pod} and {master}")

        stays = [e for e in engines if e.pub.host != pod]
        targets.write_text(_targets(stays, {n: m for n, m in masters.items() if n != master}))
        victim.send_signal(how)
        t0 = time.monotonic()
        await asyncio.to_thread(victim.wait, 20)
        for _ in range(200):  # the victim's other pods resume from the stream elsewhere
            await rng.choice(stays).step(rng)
        gone = next(e for e in engines if e.pub.host == pod)

        async def removed() -> bool:
            got = await answers(replica.http.port, [pod])
            return got is not None and all(r == [0.0] for r in got) and not l3_held(replica.indexer.l3, L3_POD[master])
        await wait_for(removed, REMOVED_WITHIN, f"{pod} and master {master} dropped from the index")
        print(f"{pod} and {master} removed {time.monotonic() - t0:.1f}s after the signal")
        assert any(gone.expected(c) for c in CHAINS), "the pod held blocks until its removal"

        others = [e.pub.host for e in stays]

        async def intact() -> bool:
            return (await answers(replica.http.port, others) == [[e.expected(c) for e in stays] for c in CHAINS]
                    and all(l3_held(replica.indexer.l3, L3_POD[m]) == {100 + i}
                            for i, m in enumerate(MASTERS) if m != master))
        await wait_for(intact, 30, "the other pods and masters exactly as their engines and masters hold")
    finally:
        await stop_all(bridges)
        await replica.stop()
        for e in engines:
            await e.pub.close()
        for m in masters.values():
            await m.runner.cleanup()
        ctx.term()


async def test_a_rank_gone_while_a_dead_bridge_holds_its_pod_is_removed_by_the_next_holder(nats_url, stream_prefix,
                                                                                          tmp_path):
    """A dead bridge (keys put in the lease bucket that nobody renews) holds pod X when X's rank 1 goes
    away: nothing is published while its lease stands (it still holds X), and the live bridge publishes
    ``rank_removed`` once the lease has run out and it holds X itself."""
    from cache_indexer.bridge.service import Bridge

    pod = "127.0.0.131"
    targets = tmp_path / "targets.yaml"
    targets.write_text("vllm: []\n")
    cfg = make_config(nats_url, stream_prefix, ingest={"sharded": True},
                      discovery={"static": {"file": str(targets)}, "refreshInterval": "100ms"})
    bridge = Bridge(cfg)
    await bridge.start()
    try:
        await wait_for(lambda: bridge.shards._kv is not None, 10, "the lease bucket")
        kv = bridge.shards._kv
        await kv.put("member.ghost-1-dead", b"1")
        await kv.create("own." + subject_token("pod:" + pod), b"ghost-1-dead")
        t0 = time.monotonic()
        ranks = "    zmqPort: 7200\n    dpRanks: {}\n"
        targets.write_text(f"vllm:\n  - ip: {pod}\n" + ranks.format(2))
        await wait_for(lambda: bridge._ranks.get(pod) == {0, 1}, 5, "both ranks listed")
        targets.write_text(f"vllm:\n  - ip: {pod}\n" + ranks.format(1))
        await wait_for(lambda: bridge._ranks.get(pod) == {0}, 5, "rank 1 gone")
        js = bridge.nc.jetstream()
        subject = f"{cfg.nats.l1Stream.subjectPrefix}.{subject_token(pod)}.1"

        async def rank_removed():
            try:
                msg = await js.get_last_msg(cfg.nats.l1Stream.name, subject)
            except NotFoundError:
                return None
            return msg if msg.headers.get("Kv-Type") == "rank_removed" else None
        await asyncio.sleep(0.5)
        assert time.monotonic() - t0 < cfg.nats.lease.ttl, "too slow to tell: the dead bridge's lease ran out"
        assert await rank_removed() is None, "published while another bridge held the pod"
        msg = await wait_for(rank_removed, 10, "rank_removed from the bridge that holds the pod after the dead one")
        assert msg.headers["Kv-Bridge"] == bridge.shards.holder
        assert time.monotonic() - t0 >= cfg.nats.lease.ttl * 0.9
    finally:
        await bridge.stop()


async def test_a_pod_removed_again_with_nothing_of_it_left_on_the_stream_is_stored_again(nats_url, stream_prefix):
    """The chaos soak (sharded, CHAOS_SEED=102): a pod removed, back, and removed again for good, each
    time after the snapshot writer had purged all its messages. Both removals followed "stream message 0"
    and so had one message id (``<pod>:removed:after:0``): JetStream dropped the second as a duplicate of
    the first (within ``duplicateWindow``), the bridges found it never on the stream and published it again
    and again, in vain, and the pod was answered for 2 minutes after it left. With nothing of the pod on
    the stream a removal follows the last message purged (the stream's first sequence less one)."""
    from cache_indexer.bridge.jetstream_publisher import JetStreamPublisher
    from cache_indexer.bridge.l1_publisher import L1Publisher
    from cache_indexer.bridge.removals import PendingRemovals
    from cache_indexer.infra.metrics import Metrics
    from cache_indexer.infra.streams import ensure_l1_stream, l1_pod_subjects

    cfg = make_config(nats_url, stream_prefix)
    l1cfg = cfg.nats.l1Stream
    nc = await nats.connect(nats_url)
    pub = JetStreamPublisher(nc, Metrics())
    try:
        js = nc.jetstream()
        await ensure_l1_stream(js, cfg.nats)
        await pub.start()
        l1 = L1Publisher(pub, l1cfg.subjectPrefix, js, l1cfg.name)
        removals = PendingRemovals(js, cfg.nats, l1, None, lambda shard: True, check_every=0, publish_every=0)
        pod = PODS[0]

        async def removed() -> int:
            """The pod's removal published until the stream shows it; its stream sequence."""
            removals.add("pod", pod)
            for _ in range(50):
                if await removals.settle():
                    msg = await js.get_last_msg(l1cfg.name, l1_pod_subjects(l1cfg.subjectPrefix, pod))
                    return msg.seq
                await pub.flush(5)
            raise AssertionError("the pod's removal never reached the stream")

        first = await removed()
        await js.purge_stream(l1cfg.name, seq=first + 1)  # behind a snapshot: nothing of the pod is left
        removals.clear()
        assert await removed() > first
    finally:
        await pub.close()
        await nc.close()
