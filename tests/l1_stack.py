"""A bridge, an indexer replica with its API, and fake vLLM engines, wired on 127.0.0.1 and a real
nats-server: the L1 path end to end, for tests and benchmarks."""

from __future__ import annotations

import json

import aiohttp
import zmq.asyncio

from cache_indexer.bridge.service import Bridge
from cache_indexer.infra.metrics import Metrics
from cache_indexer.replica import Replica
from cache_indexer.simulate.vllm_engine import VllmPublisher
from tests.conftest import wait_for


class L1Stack:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.ctx = zmq.asyncio.Context()
        self.bridge_metrics = Metrics()
        self.bridge = Bridge(cfg, self.bridge_metrics)
        self.replica = Replica(cfg)
        self.engines: list[VllmPublisher] = []
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> "L1Stack":
        await self.bridge.start()
        await self.replica.start()
        self.session = aiohttp.ClientSession(base_url=f"http://127.0.0.1:{self.replica.http.port}")
        return self

    async def next_bridge(self) -> Bridge:
        """A new bridge in the place of the one before (stopped, killed or still running: the caller's
        doing), with the same configuration and metrics, started."""
        self.bridge = Bridge(self.cfg, self.bridge_metrics)
        await self.bridge.start()
        return self.bridge

    def engine(self, host: str = "127.0.0.1", **kw) -> VllmPublisher:
        eng = VllmPublisher(self.ctx, host, kw.pop("pub_port", 0), kw.pop("replay_port", 0), **kw)
        self.engines.append(eng)
        return eng

    async def connect(self, *engines_and_pods) -> None:
        """Point the bridge at the engines ((engine, pod, rank) tuples) and wait until each is subscribed."""
        eps = [eng.endpoint(pod, rank) for eng, pod, rank in engines_and_pods]
        await self.bridge.set_endpoints(eps)
        for eng, _, _ in engines_and_pods:
            await eng.wait_subscribed()

    async def settled(self, timeout: float = 20.0) -> int:
        """Wait until the bridge has published every batch its engines sent (handed on, possibly in runs,
        and acked); the stream's last sequence then, which a replica must have applied to be up to date."""
        sent = sum(e.batches for e in self.engines)
        published = self.bridge_metrics.bridge_batches.labels("published")
        await wait_for(lambda: published._value.get() >= sent, timeout, f"the bridge to publish all {sent} batches")
        assert await self.bridge.publisher.flush(timeout), "the bridge's publishes acked"
        return (await self.replica.indexer.js.stream_info(self.cfg.nats.l1Stream.name)).state.last_seq

    async def ratios(self, pods: list[str], tokens: list[int], block_size: int, salt: str = "") -> list[float]:
        body = {"server_ip": pods, "body": {"token_ids": tokens, "cache_salt": salt, "block_size": block_size}}
        async with self.session.post("/kv-cache/hit-rate", data=json.dumps(body)) as r:
            out = await r.json()
            assert r.status == 200, out
        return [s["l1_hit_ratio"] for s in out["server_score_list"]]

    async def stop(self) -> None:
        if self.session:
            await self.session.close()
        for eng in self.engines:
            await eng.close()
        await self.replica.stop()
        await self.bridge.stop()
        self.ctx.term()
