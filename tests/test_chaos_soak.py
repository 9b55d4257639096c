"""Chaos soak: kill -9 of the bridge, of an indexer replica and of the nats-server, and SIGTERM of the
bridge, at random moments while engines publish bursts; each victim comes back after a short random
outage. The snapshot writer purges the stream behind its snapshots all along. The engines' replay
buffers are smaller than the run (4,000 batches, about a quarter of what each publishes; enough for one
outage), and one engine publishes 600 batches at the start, keeps only 100 of them, and stays idle
across the purges until the end: the last fault is always a bridge killed after its last message was
purged (issue 24). After the last fault every engine publishes once more, and both replicas must answer
exactly what the engines hold (ground truth from the engines' own events), so nothing was lost,
duplicated or left stuck. Real processes, sockets and server.

The seed is random per run and printed (``CHAOS_SEED`` replays its choices); ``CHAOS_FAULTS`` sets the
number of faults (6 by default, about a minute)."""

from __future__ import annotations

import asyncio
import os
import random
import signal

import aiohttp
import nats
import zmq.asyncio

from cache_indexer.nats_server import NatsServer
from cache_indexer.simulate.vllm_engine import VllmPublisher, removed, stored
from schemas.block_hash import BlockHasher
from tests.conftest import make_config, wait_for
from tests.test_local_mode import free_port
from tests.test_recovery import spawn, write_config

BS = 4
H = BlockHasher("sha256_cbor", "0")
PODS = ["127.0.0.81", "127.0.0.82", "127.0.0.83", "127.0.0.84"]  # the last one goes idle
ACTIVE_BUFFER, IDLE_BUFFER, IDLE_BATCHES = 4000, 100, 600
DOCS = [[(d * 104729 + i) % 60000 for i in range(BS * 10)] for d in range(12)]
CHAINS = [H.event_hashes(doc, BS) for doc in DOCS]


class Engine:
    """A fake vLLM engine and the ground truth of what it holds."""

    def __init__(self, ctx, pod: str, buffer: int = 10000) -> None:
        self.pub = VllmPublisher(ctx, pod, 0, 0, buffer_steps=buffer)
        self.held: set[int] = set()

    async def step(self, rng: random.Random) -> None:
        chain = CHAINS[rng.randrange(len(CHAINS))]
        if rng.random() < 0.75:
            new = [h for h in chain[:rng.randrange(1, len(chain) + 1)] if h not in self.held]
            if new:
                self.held.update(new)
                await self.pub.publish([stored(new, block_size=BS)])
        else:
            gone = [h for h in chain if h in self.held][-rng.randrange(1, 4):]
            if gone:
                self.held.difference_update(gone)
                await self.pub.publish([removed(gone)])

    async def store_chain(self, chain: list[int]) -> None:
        new = [h for h in chain if h not in self.held]
        self.held.update(new)
        await self.pub.publish([stored(new, block_size=BS)])

    def expected(self, chain: list[int]) -> float:
        n = 0
        while n < len(chain) and chain[n] in self.held:
            n += 1
        return n / len(chain)


async def answers(port: int, pods: list[str] = PODS, docs: list[list[int]] = DOCS) -> list[list[float]] | None:
    """A replica's ratios for every document and pod; None while it cannot answer."""
    try:
        async with aiohttp.ClientSession() as s:
            out = []
            for doc in docs:
                body = {"server_ip": pods, "body": {"token_ids": doc, "block_size": BS}}
                async with s.post(f"http://127.0.0.1:{port}/kv-cache/hit-rate", json=body) as r:
                    if r.status != 200:
                        return None
                    out.append([x["l1_hit_ratio"] for x in (await r.json())["server_score_list"]])
            return out
    except aiohttp.ClientError:
        return None


async def test_chaos_soak_kill_9_of_bridge_indexer_and_nats_loses_nothing(stream_prefix, tmp_path):
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1 << 32))
    faults = int(os.environ.get("CHAOS_FAULTS", "6"))
    rng = random.Random(seed)
    print(f"CHAOS_SEED={seed}")
    server = NatsServer(store_dir=str(tmp_path / "nats")).start()
    ctx = zmq.asyncio.Context()
    engines = [Engine(ctx, pod, ACTIVE_BUFFER) for pod in PODS[:-1]] + [Engine(ctx, PODS[-1], IDLE_BUFFER)]
    active, idle = engines[:-1], engines[-1]
    targets = tmp_path / "targets.yaml"
    targets.write_text("vllm:\n" + "".join(f"  - ip: {e.pub.host}\n    zmqPort: {e.pub.pub_port}\n"
                                           f"    replayPort: {e.pub.replay_port}\n" for e in engines))
    cfg = make_config(server.url, stream_prefix, blockKey={"pythonHashSeed": "0"},
                      snapshot={"everyMessages": 150, "interval": "1s", "purgeKeep": 50})
    ports = [free_port(), free_port()]
    files = {"bridge": write_config(cfg, tmp_path / "bridge.yaml", **{"discovery.static.file": str(targets),
                                                                      "http.port": free_port()})}
    for i, port in enumerate(ports):
        files[f"indexer{i}"] = write_config(cfg, tmp_path / f"indexer{i}.yaml", **{"http.port": port})
    procs = {name: spawn(name.rstrip("01"), "--config", str(path)) for name, path in files.items()}

    def kill(name: str) -> None:
        if name == "nats":
            server.proc.send_signal(signal.SIGKILL)
            server.proc.wait(10)
            server.proc = None
        else:  # "bridge-term": SIGTERM (a rolling update), the rest kill -9
            name, sig = ("bridge", signal.SIGTERM) if name == "bridge-term" else (name, signal.SIGKILL)
            procs[name].send_signal(sig)
            procs[name].wait(20)

    def revive(name: str) -> None:
        if name == "nats":
            server.start()
        else:
            name = name.removesuffix("-term")
            procs[name] = spawn(name.rstrip("01"), "--config", str(files[name]))

    publishing = True

    async def traffic() -> None:
        while publishing:
            await rng.choice(active).step(rng)
            await asyncio.sleep(rng.uniform(0, 0.004))

    nc = None
    try:
        for e in engines:
            await e.pub.wait_subscribed(60)
        # the idle engine: a long history first (its buffer keeps the last 100), then nothing for the run
        idle_docs = [[70000 + i * 7 + k for k in range(BS * 2)] for i in range(IDLE_BATCHES)]
        idle_chains = [H.event_hashes(doc, BS) for doc in idle_docs]
        for chain in idle_chains:
            await idle.store_chain(chain)
        pump = asyncio.create_task(traffic())
        log = []
        for _ in range(faults - 1):
            await asyncio.sleep(rng.uniform(0.5, 2.5))
            victim = rng.choice(["bridge", "bridge-term", "indexer0", "indexer1", "nats"])
            kill(victim)
            await asyncio.sleep(rng.uniform(0.2, 2.0))
            revive(victim)
            log.append(victim)
        # the last fault: the bridge, once a purge has taken the idle engine's last message
        nc = await nats.connect(server.url, max_reconnect_attempts=-1)
        js = nc.jetstream()
        idle_subject = f"{cfg.nats.l1Stream.subjectPrefix}.{PODS[-1].replace('.', '_')}.0"

        async def idle_purged() -> bool:
            try:
                await js.get_last_msg(cfg.nats.l1Stream.name, idle_subject)
                return False
            except nats.js.errors.NotFoundError:
                return True
            except Exception:
                return False
        await wait_for(idle_purged, 60, f"a purge of the idle engine's last message (seed {seed})")
        kill("bridge")
        await asyncio.sleep(rng.uniform(0.2, 2.0))
        revive("bridge")
        log.append("bridge after the purge")
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        publishing = False
        await pump
        # a last batch each (one lost on the way with nothing after it shows to no one); the comparison
        # includes them, so it holds only once the bridge has handled them
        last_docs = [[90000 + i * 11 + k for k in range(BS)] for i in range(len(engines))]
        for e, doc in zip(engines, last_docs):
            await e.store_chain(H.event_hashes(doc, BS))
        docs = DOCS + idle_docs[:5] + idle_docs[-5:] + last_docs
        want = [[e.expected(H.event_hashes(doc, BS)) for e in engines] for doc in docs]
        batches = sum(e.pub.seq for e in engines)
        for port in ports:
            async def converged(port=port) -> bool:
                return await answers(port, docs=docs) == want
            await wait_for(converged, 90, f"replica on {port} to equal the engines after {log} (seed {seed}, "
                                          f"{batches} batches): it answers {await answers(port, docs=docs)}, truth {want}")
        assert any(any(r) for r in want), "the engines hold something"
    finally:
        publishing = False
        if nc is not None:
            await nc.close()
        for p in procs.values():
            p.kill()
            p.wait(10)
        for e in engines:
            await e.pub.close()
        ctx.term()
        server.close()
