"""Mooncake polling in local mode: poll time, CPU per poll and API latency while polls run.

One `cache-indexer local` process (bridge, indexer and API on one event loop, as a laptop or a small
install runs it) polls a master in another process (bench/mooncake_master_proc.py) every 2 s; 1% of
the keys change between polls. Per key count: the API's p50/p99/max with no master (the baseline, same
process, same run), during the first poll (every key located), and during steady polls; the poll's
duration (the bridge's own histogram) and the process CPU per steady poll (from /proc, with no queries
running). The query is 2,048 tokens, block size 16, 4 candidates, sent one after another.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import free_port, percentile

ROOT = Path(__file__).resolve().parents[1]
POLL_INTERVAL = 2.0
QUERY = {"server_ip": ["127.0.3.1", "127.0.3.2", "127.0.3.3", "127.0.3.4"],
         "body": {"token_ids": list(range(2048)), "block_size": 16}}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _metric(session, name: str) -> float:
    async with session.get("/metrics") as r:
        text = await r.text()
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def _latencies(session, until) -> list[float]:
    """Queries one after another until ``until()`` is true (at least 20); seconds each."""
    out: list[float] = []
    body = json.dumps(QUERY)
    while len(out) < 20 or not await until():
        t = time.perf_counter()
        async with session.post("/kv-cache/hit-rate", data=body) as r:
            await r.read()
            assert r.status == 200, r.status
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.005)
    return out


async def _one(n: int, tree: Path = ROOT) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-l3-"))
    targets = tmp / "targets.yaml"
    targets.write_text("vllm: []\nmooncakeMasters: []\n")
    master = subprocess.Popen([sys.executable, "-m", "bench.mooncake_master_proc", "--keys", str(n),
                               "--churn-every", str(POLL_INTERVAL)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    url = master.stdout.readline().split()[1]
    port = free_port()
    env = {**os.environ, "CACHE_INDEXER_RUNTIME_DIR": str(tmp)}
    local = subprocess.Popen([sys.executable, "-m", "cache_indexer.cli", "local", "--targets", str(targets),
                              "--set", f"http.port={port}", "--set", f"ingest.l3.pollInterval={POLL_INTERVAL}s",
                              "--set", "log.level=warning", "--set", "discovery.refreshInterval=500ms"], cwd=tree,
                             env={**env, "PYTHONPATH": str(tree)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {"keys": n, "tree": "this tree" if tree == ROOT else str(tree)}
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{port}") as s:
            deadline = time.monotonic() + 60
            while True:
                try:
                    async with s.get("/readyz") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                assert time.monotonic() < deadline, "local did not become ready"
                await asyncio.sleep(0.1)
            t_end = time.monotonic() + 5
            out["baseline"] = await _latencies(s, lambda: _after(t_end))
            host, mport = url.rsplit("//", 1)[1].split(":")
            targets.write_text(f"vllm: []\nmooncakeMasters:\n  - host: {host}\n    httpPort: {mport}\n    name: bench\n")

            async def first_poll_done() -> bool:
                return await _metric(s, "cache_indexer_l3_poll_seconds_count") >= 1
            out["first"] = await _latencies(s, first_poll_done)
            out["first_poll_s"] = await _metric(s, "cache_indexer_l3_poll_seconds_sum")
            polls0 = await _metric(s, "cache_indexer_l3_poll_seconds_count")
            sum0 = await _metric(s, "cache_indexer_l3_poll_seconds_sum")
            cpu0 = _cpu_seconds(local.pid)
            while await _metric(s, "cache_indexer_l3_poll_seconds_count") < polls0 + 3:
                await asyncio.sleep(0.2)
            polls1 = await _metric(s, "cache_indexer_l3_poll_seconds_count")
            out["cpu_per_poll"] = (_cpu_seconds(local.pid) - cpu0) / (polls1 - polls0)
            out["steady_poll_s"] = (await _metric(s, "cache_indexer_l3_poll_seconds_sum") - sum0) / (polls1 - polls0)

            async def three_more_polls() -> bool:
                return await _metric(s, "cache_indexer_l3_poll_seconds_count") >= polls1 + 3
            out["steady"] = await _latencies(s, three_more_polls)
    finally:
        local.terminate()
        master.terminate()
        local.wait(30)
        master.wait(30)
    return out


async def _after(t: float) -> bool:
    return time.monotonic() >= t


def run(quick: bool = False, baseline: Path | None = None) -> list[dict]:
    """Each key count on this tree, and (``baseline``: another checkout, e.g. a git worktree of an older
    commit) on that one right after, so the two share the machine's state."""
    rows = []
    for n in ((10_000,) if quick else (10_000, 100_000, 300_000)):
        rows.append(asyncio.run(_one(n)))
        if baseline:
            rows.append(asyncio.run(_one(n, baseline)))
    return rows


def _lat(v: list[float]) -> str:
    return f"{percentile(v, 50) * 1e3:.1f} / {percentile(v, 99) * 1e3:.1f} / {max(v) * 1e3:.0f} ms"


def table(rows: list[dict]) -> str:
    lines = ["| keys | code | first poll | steady poll | CPU per steady poll | API p50 / p99 / max: no master | "
             "during the first poll | during steady polls |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['keys']:,} | {r['tree']} | {r['first_poll_s']:.2f} s | {r['steady_poll_s']:.2f} s | "
                     f"{r['cpu_per_poll']:.2f} s | {_lat(r['baseline'])} | {_lat(r['first'])} | {_lat(r['steady'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench.l3_poll", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline", type=Path, help="another checkout to run side by side (before/after)")
    args = ap.parse_args()
    print(table(run(args.quick, args.baseline)))
