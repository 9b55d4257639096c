"""How one Mooncake poll grows with the key count (10k, 100k keys).

The master is an HTTP server on loopback serving the >= 0.3.12 formats (the test suite's FakeMaster),
so the figures are the poller's own cost: the first poll (locate every key), a steady poll with no
change (list only), and a poll after 1% of the keys changed (list + locate the new 1%). A real master
adds its own listing time (100k keys: 16.6 MB in 0.34 s, ../shared/reference/mooncake).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from bridge.mooncake_poller import MasterTarget, MooncakePoller
from cache_indexer.metrics import Metrics
from schemas.config import L3IngestConfig
from tests.test_mooncake import FakeMaster, Sink, key


async def _one(n: int) -> dict:
    master = await FakeMaster().start()
    master.segments = [f"127.0.3.{i}:12000" for i in range(1, 9)]
    master.keys = {key(i, tp=i % 2): [f"127.0.3.{i % 8 + 1}:16000"] for i in range(n)}
    out = {"keys": n}
    try:
        async with aiohttp.ClientSession() as session:
            p = MooncakePoller(MasterTarget("m", master.url), L3IngestConfig(fullStateEvery=10**9), Sink(), Metrics(), session)
            for label in ("first", "steady"):
                t = time.perf_counter()
                await p.poll()
                out[label] = time.perf_counter() - t
            for i in range(n // 100):
                master.keys.pop(key(i, tp=i % 2))
                master.keys[key(n + i)] = ["127.0.3.1:16000"]
            t = time.perf_counter()
            await p.poll()
            out["changed_1pct"] = time.perf_counter() - t
    finally:
        await master.runner.cleanup()
    return out


def run(quick: bool = False) -> list[dict]:
    return [asyncio.run(_one(n)) for n in ((10_000,) if quick else (10_000, 100_000))]


def table(rows: list[dict]) -> str:
    lines = ["| keys | first poll (locate all) | steady poll (no change) | poll after 1% changed |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['keys']:,} | {r['first']:.2f} s | {r['steady']:.2f} s | {r['changed_1pct']:.2f} s |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    print(table(run(quick="--quick" in sys.argv)))
