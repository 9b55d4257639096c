"""A fleet: ``--pods`` vLLM pods of 2 data-parallel ranks (bench/fleet_engines.py, vLLM's frames, its own
process), a bridge, an indexer replica and nats-server as the chart runs them (own processes, a static
targets file), and a probe asking the replica about the fleet's shared system prompt every 5 ms
throughout (the query path's latency, one request at a time: a pause of the event loop shows as its
maximum). Phases:

- fill: every rank stores the shared prompt and its own blocks (``blocks`` a rank); time until the
  replica holds them all: end-to-end ingest; resident memory of the indexer and of the bridge;
- snapshots: the replica writes them as it goes (every 3 s here, ``snapshot.interval``); their size, write time
  and the ingest pause they cause (the copy runs off the event loop) from the replica's log and metrics;
- rolling update: pod after pod, each rank restarts (seq from 0: the bridge resets it, the indexer
  clears the worker) and fills again;
- restore: the replica killed with SIGKILL and started again: time until ``/readyz`` says 200 (it says
  503 meanwhile), from the snapshot plus the stream's tail.

Default: 100 pods x 2 ranks x 5,000 blocks (1M entries) for this 2-core machine; ``--full``: 1,000 pods x
2 ranks x 25,000 blocks (50M entries).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import free_port, percentile
from bench.fleet_engines import BLOCK, PROMPT, pod_host
from cache_indexer.nats_server import NatsServer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = {"pods": 100, "ranks": 2, "blocks": 5_000}
FULL = {"pods": 1_000, "ranks": 2, "blocks": 25_000}
PROBE_EVERY = 0.005


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _spawn(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


class Probe:
    """One small hit-rate request at a time, every PROBE_EVERY; latencies by phase."""

    def __init__(self, url: str, pod: str) -> None:
        self.url = url
        self.body = json.dumps({"server_ip": [pod], "body": {"token_ids": PROMPT, "block_size": BLOCK}})
        self.phase = "start"
        self.samples: dict[str, list[float]] = {}
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as s:
            while True:
                t = time.perf_counter()
                try:
                    async with s.post(self.url, data=self.body, headers={"Content-Type": "application/json"}) as r:
                        await r.read()
                        ok = r.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    self.samples.setdefault(self.phase, []).append(time.perf_counter() - t)
                await asyncio.sleep(PROBE_EVERY)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def summary(self, phase: str) -> dict:
        xs = self.samples.get(phase, [])
        return {"n": len(xs), "p50_ms": percentile(xs, 50) * 1e3 if xs else None,
                "p99_ms": percentile(xs, 99) * 1e3 if xs else None, "max_ms": max(xs) * 1e3 if xs else None}


async def _metric(session: aiohttp.ClientSession, port: int, name: str) -> float:
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            text = await r.text()
    except aiohttp.ClientError:
        return 0.0
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _until(predicate, timeout: float, every: float = 0.05) -> float:
    t = time.monotonic()
    while not await predicate():
        if time.monotonic() - t > timeout:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(every)
    return time.monotonic() - t


async def _run(size: dict) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    targets = tmp / "targets.yaml"
    entries = size["pods"] * size["ranks"] * size["blocks"]
    nats = NatsServer(store_dir=str(tmp / "nats")).start()
    api, bridge_port = free_port(), free_port()
    common = ["--set", f"nats.url={nats.url}", "--set", "http.host=127.0.0.1", "--set", "log.level=info",
              "--set", "snapshot.interval=3s",
              "--set", "ingest.l1.blockKeyCheckInterval=0"]
    indexer_args = ["-m", "cache_indexer.cli", "indexer", *common, "--set", f"http.port={api}"]
    engines = _spawn(["-m", "bench.fleet_engines", "--pods", str(size["pods"]), "--ranks", str(size["ranks"]),
                      "--blocks", str(size["blocks"]), "--targets", str(targets)],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not targets.exists():
        if engines.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the fleet's engines did not start (see their stderr above)")
        await asyncio.sleep(0.05)
    bridge = _spawn(["-m", "cache_indexer.cli", "bridge", *common, "--set", f"http.port={bridge_port}",
                     "--set", f"discovery.static.file={targets}"], stderr=subprocess.DEVNULL)
    indexer_log = open(tmp / "indexer.log", "w")
    indexer = _spawn(indexer_args, stderr=indexer_log)
    out: dict = {"size": dict(size, entries=entries)}
    probe = Probe(f"http://127.0.0.1:{api}/kv-cache/hit-rate", pod_host(0))
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                try:
                    async with s.get(f"http://127.0.0.1:{api}/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False
            await _until(ready, 120)
            assert (await asyncio.to_thread(engines.stdout.readline)).startswith("SUBSCRIBED")
            probe.start()
            rss0 = _rss(indexer.pid)

            async def holding() -> bool:
                return await _metric(s, api, 'cache_indexer_index_entries{tier="l1"}') >= entries

            probe.phase = "fill"
            t = time.monotonic()
            engines.stdin.write("fill\n")
            engines.stdin.flush()
            await _until(holding, 3600, every=0.2)
            out["fill_s"] = time.monotonic() - t
            out["ingest_entries_per_s"] = entries / out["fill_s"]
            out["indexer_rss_mb"] = _rss(indexer.pid) / 1e6
            out["bytes_per_entry"] = (_rss(indexer.pid) - rss0) / entries
            out["bridge_rss_mb"] = _rss(bridge.pid) / 1e6
            assert (await asyncio.to_thread(engines.stdout.readline)).startswith("FILLED")
            probe.phase = "steady"
            await asyncio.sleep(5)
            probe.phase = "rolling update"
            t = time.monotonic()
            engines.stdin.write("restart\n")
            engines.stdin.flush()
            assert (await asyncio.to_thread(engines.stdout.readline)).startswith("RESTARTED")

            async def caught_up() -> bool:
                return await holding() and await _metric(s, api, "cache_indexer_ingest_lag_messages") == 0
            await asyncio.sleep(2.5)  # the lag gauge is updated every 2 s
            await _until(caught_up, 3600, every=0.2)
            out["rolling_update_s"] = time.monotonic() - t
            probe.phase = "after"
            pauses = await _metric(s, api, "cache_indexer_snapshot_ingest_pause_seconds_sum")
            count = await _metric(s, api, "cache_indexer_snapshot_ingest_pause_seconds_count")
            out["snapshots"] = int(count)
            out["snapshot_ingest_pause_ms"] = pauses / count * 1e3 if count else None
            indexer_log.flush()
            written = re.findall(r"snapshot at stream seq \d+: ([\d.]+) MB in ([\d.]+)s", (tmp / "indexer.log").read_text())
            if written:
                out["snapshot_mb"], out["snapshot_write_s"] = float(written[-1][0]), float(written[-1][1])
            await probe.stop()
            out["probe"] = {phase: probe.summary(phase) for phase in ("fill", "steady", "rolling update")}
            indexer.send_signal(signal.SIGKILL)
            indexer.wait()
            t = time.monotonic()
            indexer = _spawn(indexer_args, stderr=indexer_log)
            unready = 0

            async def ready_counted() -> bool:
                nonlocal unready
                ok = await ready()
                unready += not ok
                return ok
            await _until(ready_counted, 600)
            out["restore_to_ready_s"] = time.monotonic() - t
            out["readyz_503_while_loading"] = unready
    finally:
        for p in (engines, bridge, indexer):
            p.kill()
            p.wait()
        indexer_log.close()
        nats.close()
    return out


def run(quick: bool = False, full: bool = False) -> dict:
    size = dict(FULL if full else DEFAULT)
    if quick:
        size.update(pods=20, blocks=1_000)
    return asyncio.run(_run(size))


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def table(res: dict) -> str:
    z = res["size"]
    rows = [
        "| measure | value |", "|---|---|",
        f"| fleet | {z['pods']:,} pods x {z['ranks']} ranks x {z['blocks']:,} blocks = {z['entries']:,} entries |",
        f"| fill, end to end (engines -> bridge -> JetStream -> replica) | {res['fill_s']:.1f} s: "
        f"{res['ingest_entries_per_s']:,.0f} entries/s |",
        f"| replica resident memory | {res['indexer_rss_mb']:,.0f} MB ({res['bytes_per_entry']:.0f} B per entry) |",
        f"| bridge resident memory | {res['bridge_rss_mb']:,.0f} MB |",
        f"| snapshots written / size / write time | {res['snapshots']} / {res.get('snapshot_mb', '-')} MB / "
        f"{res.get('snapshot_write_s', '-')} s |",
        f"| ingest paused by a snapshot's table copy (mean) | {_ms(res['snapshot_ingest_pause_ms'])} |",
        f"| rolling update of every pod (restart, reset, refill) until all held again | {res['rolling_update_s']:.1f} s |",
        f"| replica killed with SIGKILL: restart to ready (503s answered while loading) | "
        f"{res['restore_to_ready_s']:.1f} s ({res['readyz_503_while_loading']}) |",
    ]
    for phase, p in res["probe"].items():
        rows.append(f"| probe during {phase}: p50 / p99 / max ({p['n']:,} requests) | {_ms(p['p50_ms'])} / "
                    f"{_ms(p['p99_ms'])} / {_ms(p['max_ms'])} |")
    return "\n".join(rows)
