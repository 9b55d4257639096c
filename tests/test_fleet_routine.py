"""Issue 36: a fleet's routine operations lose nothing and leave nothing phantom. Real nats-server, the
bridge and the indexer replica as processes (bridge restarts by SIGTERM), engines in vLLM's frames with
replay buffers smaller than their history; each case ends in the index equal to the engines' truth,
per worker (every chain each engine rank holds, asked through ``POST /query``).

- a readiness flap shorter than ``ingest.l1.removalGrace`` keeps what only the engine's cache holds;
- one DP rank unregistered (or dropped from ``dpRanks``) goes alone;
- an engine registered while idle is indexed from its buffer at once, without publishing;
- an idle DP rank keeps its resume record through bridge restarts, so a purge does not take its history.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import yaml

from cache_indexer.simulate.vllm_engine import VllmPublisher, stored
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import http_ready, make_config, metric_value, wait_for
from tests.test_fleet_shape import _pod_ports
from tests.test_local_mode import free_port
from tests.test_recovery import write_config

ROOT = Path(__file__).resolve().parents[1]
H = BlockHasher("sha256_cbor", "0")
BS = 4
BLOCKS = 4  # a chain: one batch of BLOCKS blocks, parents within it
TOKEN = "fleet-routine-token"


def chain_tokens(engine: int, k: int) -> list[int]:
    return [(engine * 1_000_003 + k * 7919 + i) % 900_000 + 1 for i in range(BLOCKS * BS)]


class Rank:
    """A fake engine rank and what it holds (its truth): the chains it stored."""

    def __init__(self, ctx, n: int, host: str, rank: int = 0, buffer_steps: int = 10_000, ports=(0, 0)) -> None:
        self.n, self.host, self.rank = n, host, rank
        self.pub = VllmPublisher(ctx, host, ports[0], ports[1], dp_rank=rank, buffer_steps=buffer_steps)
        self.chains: list[list[int]] = []
        #: chains it stored that the index must no longer answer for it (the rank was removed)
        self.dropped: list[list[int]] = []

    def remove(self) -> None:
        """The rank leaves: what it held is no longer the index's to answer for it."""
        self.dropped, self.chains = self.dropped + self.chains, []

    async def store_chain(self) -> None:
        tokens = chain_tokens(self.n, len(self.chains))
        hashes = H.event_hashes(tokens, BS)
        await self.pub.publish([stored(hashes, block_size=BS, token_ids=tokens)])
        self.chains.append(tokens)


class Fleet:
    """nats-server (the fixture's), an indexer process with its API, bridge processes over a targets file."""

    def __init__(self, cfg, tmp: Path) -> None:
        import zmq.asyncio

        self.cfg, self.tmp = cfg, tmp
        self.ctx = zmq.asyncio.Context()
        self.ranks: list[Rank] = []
        self.api, self.bridge_port = free_port(), free_port()
        self.targets = tmp / "targets.yaml"
        self.targets.write_text("vllm: []\n")
        self.procs: list[subprocess.Popen] = []
        self.bridge: subprocess.Popen | None = None
        self.session: aiohttp.ClientSession | None = None

    def _spawn(self, role: str, **overrides) -> subprocess.Popen:
        path = write_config(self.cfg, self.tmp / f"{role}-{len(self.procs)}.yaml", **overrides)
        log = open(self.tmp / f"{role}-{len(self.procs)}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", role, "--config", str(path)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=log)
        self.procs.append(proc)
        return proc

    async def start(self) -> "Fleet":
        self._spawn("indexer", **{"http.port": self.api})
        self.session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{self.api}")
        await wait_for(lambda: http_ready(self.session, f"http://127.0.0.1:{self.api}/readyz"), 30, "the replica ready")
        self.start_bridge()
        return self

    def start_bridge(self) -> None:
        self.bridge = self._spawn("bridge", **{"http.port": self.bridge_port, "discovery.static.file": str(self.targets)})

    async def restart_bridge(self) -> None:
        self.bridge.send_signal(signal.SIGTERM)
        self.bridge.wait(30)
        self.start_bridge()

    async def subscriptions(self) -> float | None:
        return await metric_value(self.session, self.bridge_port, "cache_indexer_bridge_subscriptions")

    def list_pods(self, pods: list[tuple[str, int, int, int]]) -> None:
        """(ip, pub port, replay port, dp ranks) of each pod (ports of rank r: the port + r)."""
        self.targets.write_text(yaml.safe_dump({"vllm": [
            {"ip": ip, "zmqPort": pub, "replayPort": replay, "dpRanks": ranks} for ip, pub, replay, ranks in pods]}))

    async def held(self, tokens: list[int]) -> dict[tuple[str, int], int]:
        """(pod, rank) -> blocks of ``tokens`` held from block 0, as the replica answers ``/query``."""
        async with self.session.post("/query", json={"token_ids": tokens, "model_name": "m", "block_size": BS}) as r:
            out = await r.json()
            assert r.status == 200, out
        return {(pod, int(rank)): n // BS for pod, inst in out["instances"].items() for rank, n in inst["dp"].items()}

    async def differences(self, ranks: list[Rank], pod_of=lambda r: r.host) -> list:
        """Chains where the replica's answer for a worker is not the engine's truth (every chain of every
        rank, asked once each: every worker's answer for it is compared)."""
        truth: dict[tuple, set] = {}
        for r in ranks:
            for tokens in r.dropped:
                truth.setdefault(tuple(tokens), set())
        for r in ranks:
            for tokens in r.chains:
                truth.setdefault(tuple(tokens), set()).add((pod_of(r), r.rank))
        out = []
        for tokens, holders in truth.items():
            held = await self.held(list(tokens))
            got, full = {w for w, n in held.items() if n}, {w for w, n in held.items() if n == BLOCKS}
            if got != holders or full != holders:
                out.append((tokens[:2], sorted(holders), sorted(got)))
        return out

    def rank(self, n: int, host: str, rank: int = 0, **kw) -> Rank:
        r = Rank(self.ctx, n, host, rank, **kw)
        self.ranks.append(r)
        return r

    def two_ranks(self, ns: tuple[int, int], host: str, **kw) -> tuple[Rank, Rank]:
        """A pod's two DP ranks on consecutive ports (rank r listens at the pod's ports + r)."""
        base = _pod_ports(host, 2)
        return tuple(self.rank(n, host, r, ports=(base + r, base + 2 + r), **kw) for r, n in enumerate(ns))

    async def stop(self) -> None:
        for r in self.ranks:
            await r.pub.close()
        if self.session is not None:
            await self.session.close()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.ctx.term()


async def converged(fleet: Fleet, ranks: list[Rank], what: str, timeout: float = 40.0, **kw) -> None:
    last: list = []

    async def equal() -> bool:
        nonlocal last
        last = await fleet.differences(ranks, **kw)
        return not last
    try:
        await wait_for(equal, timeout, what)
    except AssertionError:
        raise AssertionError(f"{what}: {len(last)} chains differ, e.g. {last[:3]}") from None


@pytest.fixture
async def fleet(cfg, tmp_path):
    """A started Fleet (a test changes ``cfg`` first, where it needs to, by asking for it before this)."""
    f = Fleet(cfg, tmp_path)
    try:
        yield await f.start()
    finally:
        await f.stop()


@pytest.fixture
def cfg(nats_url, stream_prefix):
    return make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0", "blockSize": BS},
                       http={"registrationToken": TOKEN},
                       ingest={"l1": {"blockKeyCheckInterval": 0, "replayCooldown": 0, "replayTimeout": "2s",
                                      "backoffInitial": "100ms", "backoffMax": "1s"}})


@pytest.mark.timeout(180)
async def test_a_readiness_flap_shorter_than_the_grace_keeps_history_older_than_the_engines_buffer(fleet):
    """Case 1: an engine with a 200-batch buffer stores 1,000 chains and idles; its pod leaves the targets
    for about 2 s and comes back; it stores one more. All 1,001 chains stay indexed (before, 200: the
    pod was removed at once and the returning engine started anew from its buffer)."""
    x, other = fleet.rank(1, "127.0.36.1", buffer_steps=200), fleet.rank(2, "127.0.36.2", buffer_steps=200)
    pods = [(r.host, r.pub.pub_port, r.pub.replay_port, 1) for r in (x, other)]
    fleet.list_pods(pods)
    for r in (x, other):
        await r.pub.wait_subscribed(30)
    for _ in range(1000):
        await x.store_chain()
    await other.store_chain()
    await converged(fleet, [x, other], "1,000 chains indexed")
    fleet.list_pods(pods[1:])  # the flap: X leaves discovery ...
    await wait_for(lambda: _is(fleet.subscriptions(), 1), 20, "X unsubscribed")
    fleet.list_pods(pods)  # ... and is back, well within the grace
    await wait_for(lambda: _is(fleet.subscriptions(), 2), 20, "X subscribed again")
    await x.pub.wait_subscribed(30)
    await x.store_chain()
    await converged(fleet, [x, other], "every chain of X after the flap")


async def _is(coro, value) -> bool:
    return (await coro) == value


async def _post(fleet: Fleet, path: str, body: dict) -> tuple[int, dict]:
    async with fleet.session.post(path, json=body, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
        return r.status, await r.json()


def _registration(r: Rank, instance: str) -> dict:
    return {"instance_id": instance, "dp_rank": r.rank, "endpoint": f"tcp://{r.host}:{r.pub.pub_port}",
            "replay_endpoint": f"tcp://{r.host}:{r.pub.replay_port}", "model_name": "m", "block_size": BS}


@pytest.mark.timeout(120)
async def test_unregistering_one_dp_rank_drops_that_rank_only(fleet):
    """Case 2: an instance registered with ranks 0 and 1, both indexed; ``/unregister`` of rank 1 alone:
    its 20 chains leave the index (before, they stayed: removal was per pod), rank 0's stay."""
    r0, r1 = fleet.rank(3, "127.0.36.3", 0), fleet.rank(4, "127.0.36.3", 1)
    for r in (r0, r1):
        assert (await _post(fleet, "/register", _registration(r, "inst")))[0] == 201
        await r.pub.wait_subscribed(30)
        for _ in range(20):
            await r.store_chain()
    await converged(fleet, [r0, r1], "both ranks indexed", pod_of=lambda r: "inst")
    assert await _post(fleet, "/unregister", {"instance_id": "inst", "dp_rank": 1}) == (200, {"status": "ok"})
    r1.remove()  # what the index may answer for rank 1 now: nothing
    await converged(fleet, [r0, r1], "rank 1 dropped, rank 0 kept", pod_of=lambda r: "inst")
    await r0.store_chain()
    await converged(fleet, [r0, r1], "rank 0 goes on", pod_of=lambda r: "inst")


@pytest.mark.timeout(120)
async def test_a_dp_rank_dropped_from_the_targets_goes_alone(fleet):
    """Case 2, by discovery: a pod's ``dpRanks`` goes from 2 to 1: rank 1 leaves the index, rank 0 stays."""
    r0, r1 = fleet.two_ranks((5, 6), "127.0.36.5")
    fleet.list_pods([(r0.host, r0.pub.pub_port, r0.pub.replay_port, 2)])
    for r in (r0, r1):
        await r.pub.wait_subscribed(30)
        for _ in range(10):
            await r.store_chain()
    await converged(fleet, [r0, r1], "both ranks indexed")
    fleet.list_pods([(r0.host, r0.pub.pub_port, r0.pub.replay_port, 1)])
    r1.remove()
    await converged(fleet, [r0, r1], "rank 1 dropped, rank 0 kept")


@pytest.mark.timeout(120)
async def test_an_engine_registered_while_idle_is_indexed_from_its_buffer_at_once(fleet):
    """Case 4: the engine's history sits in its replay buffer (published before anyone subscribed); it
    is registered and publishes nothing more. Its chains are answered (before: 0 until it published)."""
    idle = fleet.rank(7, "127.0.36.7")
    for _ in range(30):
        await idle.store_chain()  # nobody subscribed: only its buffer holds them
    assert (await _post(fleet, "/register", _registration(idle, "idle-engine")))[0] == 201
    await converged(fleet, [idle], "the idle engine's chains indexed without a new batch",
                    pod_of=lambda r: "idle-engine")
    assert idle.pub.batches == 30


@pytest.fixture
def purging(cfg):
    """Snapshots every 150 stream messages, keeping 100: a busy rank purges an idle one's messages."""
    cfg.snapshot.everyMessages, cfg.snapshot.purgeKeep = 150, 100
    cfg.ingest.l1.coalesceMaxBatches = 1  # a stream message a batch
    return cfg


@pytest.mark.timeout(240)
async def test_an_idle_dp_rank_keeps_its_history_through_two_bridge_restarts_and_a_purge(purging, fleet):
    """Case 5: rank 1 stores 300 chains and idles, rank 0 keeps publishing; the bridge restarts, the
    snapshot writer purges (keeping 100 messages), the bridge restarts again; rank 1 stores one more.
    All 301 stay indexed (before: the first restart rewrote the pod's record with rank 0 only, and the
    second found neither a record nor a message for rank 1: a new generation from its 100-batch buffer)."""
    r0, r1 = fleet.two_ranks((8, 9), "127.0.36.8", buffer_steps=100)
    fleet.list_pods([(r0.host, r0.pub.pub_port, r0.pub.replay_port, 2)])
    for r in (r0, r1):
        await r.pub.wait_subscribed(30)
    for _ in range(300):
        await r1.store_chain()
    await converged(fleet, [r0, r1], "rank 1's 300 chains indexed")
    for restart in range(2):
        await fleet.restart_bridge()
        for r in (r0, r1):
            await r.pub.wait_subscribed(30)
        for _ in range(200):  # rank 0 busy: snapshots purge rank 1's messages from the stream
            await r0.store_chain()
        await converged(fleet, [r0, r1], f"rank 0's chains after restart {restart + 1}")
    await r1.store_chain()
    await converged(fleet, [r0, r1], "all 301 chains of the idle rank")
