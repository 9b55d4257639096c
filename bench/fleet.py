"""A fleet: ``--pods`` vLLM pods of 2 data-parallel ranks (bench/fleet_engines.py, vLLM's frames, its own
process), a bridge, an indexer replica and nats-server as the chart runs them (own processes), the pods
found through the Kubernetes list/watch path (the bridge in ``discovery.mode: kubernetes`` against an API
endpoint of this process serving pod lists and watches, tests/kube_fake.py), and a probe asking the
replica about the fleet's shared system prompt every 5 ms throughout. Phases:

- fill: every rank stores the shared prompt and its own blocks (``blocks`` a rank); time until the
  replica holds them all: end-to-end ingest; resident memory of the indexer and of the bridge;
- snapshots: the fleet at rest, a store now and then, until the replica (the snapshot writer) has
  written two snapshots of the whole index: their size, write time and the ingest pause they cause;
- rolling update: pod after pod, each rank restarts (seq from 0: the bridge resets it, the indexer
  clears the worker) and fills again;
- discovery churn: every pod deleted from the Kubernetes API (the bridge publishes their removal, the
  replica clears 2 workers a pod), then every pod added back under a new uid (the bridge subscribes
  again and replays each engine's buffer): until the index is empty, then full again;
- restore: the replica killed with SIGKILL and started again: time until ``/readyz`` says 200 (it says
  503 meanwhile), from the snapshot plus the stream's tail.

The query path is measured per phase by the probe (end to end, what a router sees, including the
probe's own wait for a core) and by the replica itself (infra/loop_lag.py): the steps of its event loop
in CPU time (``cache_indexer_event_loop_step_seconds``: its own work, which a query arriving meanwhile
waits for, whatever else runs on the machine) and how late its timers fired (wall clock, waiting
for a core included).
With two or more cores (``pin``), the replica and the probe get the last core and everything else
(engines, bridge, nats-server) the others, as a replica with its own CPU request would.

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
import yaml

from bench.common import free_port, percentile
from bench.fleet_engines import BLOCK, PROMPT, PUB_PORT, REPLAY_PORT, pod_host
from cache_indexer.nats_server import NatsServer
from tests.kube_fake import FakeKubeApi, make_pod

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = {"pods": 100, "ranks": 2, "blocks": 5_000}
FULL = {"pods": 1_000, "ranks": 2, "blocks": 25_000}
PROBE_EVERY = 0.005


def _status(pid: int, field: str) -> int:
    """Bytes of a /proc/<pid>/status field (VmRSS: resident now, VmHWM: the most resident so far)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _rss(pid: int) -> int:
    return _status(pid, "VmRSS")


def _pin(pid: int, cpus: set[int] | None) -> None:
    """Every thread of a running process onto ``cpus`` (threads it starts later inherit it)."""
    if cpus:
        for task in os.listdir(f"/proc/{pid}/task"):
            os.sched_setaffinity(int(task), cpus)


def _spawn(args: list[str], cpus: set[int] | None = None, env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None, **kw)


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


async def _scrape(session: aiohttp.ClientSession, port: int) -> str:
    try:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as r:
            return await r.text()
    except aiohttp.ClientError:
        return ""


async def _metric(session: aiohttp.ClientSession, port: int, name: str) -> float:
    total = 0.0
    for line in (await _scrape(session, port)).splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _loop_buckets(session: aiohttp.ClientSession, port: int) -> dict[str, dict[float, float]]:
    """A process's event-loop histograms: "lag" and "step" -> {upper bound: cumulative count}."""
    out: dict[str, dict[float, float]] = {"lag": {}, "step": {}}
    for line in (await _scrape(session, port)).splitlines():
        for name in out:
            prefix = f"cache_indexer_event_loop_{name}_seconds_bucket{{le=\""
            if line.startswith(prefix):
                le, value = line[len(prefix):].split('"} ')
                out[name][float("inf") if le == "+Inf" else float(le)] = float(value)
    return out


def _loop_between(before: dict, after: dict) -> dict:
    """Per histogram, over a phase: how many were over 10 ms, and the bucket the longest fell in (steps
    are counted from 1 ms: none means none as long)."""
    out = {}
    for name, hist in after.items():
        diff = {le: n - before.get(name, {}).get(le, 0) for le, n in hist.items()}
        total = diff.get(float("inf"), 0)
        longest = min((le for le, n in diff.items() if n == total), default=None) if total else None
        out[name] = {"count": int(total), "longest_le_ms": longest * 1e3 if longest is not None else None,
                     "over_10ms": int(total - diff.get(0.01, 0))}
    return out


async def _until(predicate, timeout: float, every: float = 0.05) -> float:
    t = time.monotonic()
    while not await predicate():
        if time.monotonic() - t > timeout:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(every)
    return time.monotonic() - t


def _fleet_pods(n: int, ranks: int) -> list[dict]:
    return [make_pod(f"vllm-{i}", pod_host(i), zmq_port=PUB_PORT, replay_port=REPLAY_PORT,
                     annotations={"openfuyao.com/dp-ranks": str(ranks)}) for i in range(n)]


def _kubeconfig(path: Path, url: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "bench",
        "clusters": [{"name": "bench", "cluster": {"server": url}}],
        "contexts": [{"name": "bench", "context": {"cluster": "bench", "user": "bench", "namespace": "infer"}}],
        "users": [{"name": "bench", "user": {}}]}))
    return path


async def _run(size: dict, pin: bool = True, bridges: int = 1) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    targets = tmp / "targets.yaml"
    entries = size["pods"] * size["ranks"] * size["blocks"]
    cpus = sorted(os.sched_getaffinity(0))
    mine = {cpus[-1]} if pin and len(cpus) > 1 else None  # the replica's and the probe's core
    rest = set(cpus[:-1]) if mine else None
    if mine:
        os.sched_setaffinity(0, mine)
    nats = NatsServer(store_dir=str(tmp / "nats")).start()
    _pin(nats.proc.pid, rest)
    kube = await FakeKubeApi().start()
    pods = _fleet_pods(size["pods"], size["ranks"])
    for pod in pods:
        kube.add(pod)
    api, bridge_port = free_port(), free_port()
    common = ["--set", f"nats.url={nats.url}", "--set", "http.host=127.0.0.1", "--set", "log.level=info",
              "--set", "snapshot.interval=3s",
              "--set", "ingest.l1.blockKeyCheckInterval=0"]
    indexer_args = ["-m", "cache_indexer.cli", "indexer", *common, "--set", f"http.port={api}"]
    engines = _spawn(["-m", "bench.fleet_engines", "--pods", str(size["pods"]), "--ranks", str(size["ranks"]),
                      "--blocks", str(size["blocks"]), "--targets", str(targets)], rest,
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not targets.exists():
        if engines.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the fleet's engines did not start (see their stderr above)")
        await asyncio.sleep(0.05)
    bridge_log = open(tmp / "bridge.log", "w")
    # the fleet's 2,000 engines answer replays from one Python process (vLLM: a process each), slower
    # than vLLM's: a replay that times out turns its gap into a reset during the cooldown
    kubeconfig = _kubeconfig(tmp / "kubeconfig", kube.url)

    def start_bridge(port: int) -> subprocess.Popen:
        sharded = ["--set", "ingest.sharded=true"] if bridges > 1 else []
        return _spawn(["-m", "cache_indexer.cli", "bridge", *common, "--set", f"http.port={port}", *sharded,
                       "--set", "ingest.l1.replayTimeout=30s",
                       # the churn phase times removal itself: pods leave for good, not in a flap
                       "--set", "ingest.l1.removalGrace=0",
                       "--set", "discovery.mode=kubernetes", "--set", "discovery.namespace=infer"], rest,
                      env={"KUBECONFIG": str(kubeconfig)}, stderr=bridge_log)
    bridge = start_bridge(bridge_port)
    others = [start_bridge(free_port()) for _ in range(bridges - 1)]  # sharded: the pods spread over them
    indexer_log = open(tmp / "indexer.log", "w")
    indexer = _spawn(indexer_args, mine, stderr=indexer_log)
    out: dict = {"size": dict(size, entries=entries), "pinned": bool(mine), "bridges": bridges, "lag": {},
                 "bridge_lag": {}}
    probe = Probe(f"http://127.0.0.1:{api}/kv-cache/hit-rate", pod_host(0))
    try:
        async with aiohttp.ClientSession() as s:
            async def ready() -> bool:
                try:
                    async with s.get(f"http://127.0.0.1:{api}/readyz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            async def count(name: str) -> float:
                return await _metric(s, api, name)

            async def holding() -> bool:
                return await count('cache_indexer_index_entries{tier="l1"}') >= entries

            async def caught_up() -> bool:
                return await holding() and await count("cache_indexer_ingest_lag_messages") == 0

            async def phase(name: str, work) -> float:
                probe.phase = name
                before, t = await _loop_buckets(s, api), time.monotonic()
                bridge_before = await _loop_buckets(s, bridge_port)
                await work()
                took = time.monotonic() - t
                out["lag"][name] = _loop_between(before, await _loop_buckets(s, api))
                out["bridge_lag"][name] = _loop_between(bridge_before, await _loop_buckets(s, bridge_port))
                return took

            def command(line: str, answer: str):
                async def send() -> None:
                    engines.stdin.write(line + "\n")
                    engines.stdin.flush()
                    got = await asyncio.to_thread(engines.stdout.readline)
                    assert got.startswith(answer), got
                return send

            await _until(ready, 120)
            assert (await asyncio.to_thread(engines.stdout.readline)).startswith("SUBSCRIBED")
            probe.start()
            rss0 = _rss(indexer.pid)

            async def fill() -> None:
                await command("fill", "FILLED")()
                await _until(holding, 3600, every=0.2)
            out["fill_s"] = await phase("fill", fill)
            out["ingest_entries_per_s"] = entries / out["fill_s"]
            out["indexer_rss_mb"] = _rss(indexer.pid) / 1e6
            out["bytes_per_entry"] = (_rss(indexer.pid) - rss0) / entries
            out["bridge_rss_mb"] = _rss(bridge.pid) / 1e6  # the first bridge's

            writes = "cache_indexer_snapshot_writes_total"

            async def snapshots() -> None:
                written = await count(writes)
                await command("trickle", "TRICKLING")()
                await _until(lambda: _at_least(count(writes), written + 2), 1800, every=0.2)
                await command("still", "STILL")()
            out["snapshots_phase_s"] = await phase("snapshots", snapshots)
            pauses = await count("cache_indexer_snapshot_ingest_pause_seconds_sum")
            taken = await count("cache_indexer_snapshot_ingest_pause_seconds_count")
            out["snapshots"] = int(taken)
            out["snapshot_ingest_pause_ms"] = pauses / taken * 1e3 if taken else None
            indexer_log.flush()
            written = re.findall(r"snapshot at stream seq \d+: ([\d.]+) MB in ([\d.]+)s", (tmp / "indexer.log").read_text())
            if written:
                out["snapshot_mb"], out["snapshot_write_s"] = float(written[-1][0]), float(written[-1][1])

            async def rolling() -> None:
                await command("restart", "RESTARTED")()
                await asyncio.sleep(2.5)  # the lag gauge is updated every 2 s
                await _until(caught_up, 3600, every=0.2)
            out["rolling_update_s"] = await phase("rolling update", rolling)

            async def churn() -> None:
                t = time.monotonic()
                for pod in pods:
                    kube.delete(pod["metadata"]["name"])
                await _until(lambda: _at_most(count('cache_indexer_index_entries{tier="l1"}'), 0), 1800, every=0.2)
                out["churn_removed_s"] = time.monotonic() - t
                t = time.monotonic()
                for pod in _fleet_pods(size["pods"], size["ranks"]):  # back, as new pods (new uids)
                    kube.add(pod)
                await command("touch", "TOUCHED")()  # engines at work: each rank publishes, the bridge replays
                await _until(caught_up, 600, every=0.2)
                out["churn_back_s"] = time.monotonic() - t
            out["churn_s"] = await phase("discovery churn", churn)
            probe.phase = "after"
            await probe.stop()
            out["probe"] = {name: probe.summary(name) for name in ("fill", "snapshots", "rolling update",
                                                                   "discovery churn")}
            out["indexer_peak_mb"] = _status(indexer.pid, "VmHWM") / 1e6  # snapshots included
            out["bridge_peak_mb"] = _status(bridge.pid, "VmHWM") / 1e6
            indexer.send_signal(signal.SIGKILL)
            indexer.wait()
            t = time.monotonic()
            indexer = _spawn(indexer_args, mine, stderr=indexer_log)
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
        for p in (engines, bridge, indexer, *others):
            p.kill()
            p.wait()
        indexer_log.close()
        bridge_log.close()
        nats.close()
        await kube.stop()
    return out


async def _at_least(value, bound: float) -> bool:
    return await value >= bound


async def _at_most(value, bound: float) -> bool:
    return await value <= bound


def run(quick: bool = False, full: bool = False, pin: bool = True) -> dict:
    size = dict(FULL if full else DEFAULT)
    if quick:
        size.update(pods=20, blocks=1_000)
    return asyncio.run(_run(size, pin))


def _ms(x) -> str:
    return "-" if x is None else f"{x:.1f} ms"


def _loop(x: dict) -> str:
    longest = "none over 1 ms" if x["longest_le_ms"] is None else f"longest <= {_ms(x['longest_le_ms'])}"
    return f"{x['over_10ms']} over 10 ms, {longest}"


def table(res: dict) -> str:
    z = res["size"]
    rows = [
        "| measure | value |", "|---|---|",
        f"| fleet | {z['pods']:,} pods x {z['ranks']} ranks x {z['blocks']:,} blocks = {z['entries']:,} entries, "
        f"found through Kubernetes list/watch{'; replica and probe on a core of their own' if res['pinned'] else ''}"
        f"{f'; {b} sharded bridges' if (b := res.get('bridges', 1)) > 1 else ''} |",
        f"| fill, end to end (engines -> bridge -> JetStream -> replica) | {res['fill_s']:.1f} s: "
        f"{res['ingest_entries_per_s']:,.0f} entries/s |",
        f"| replica resident memory after the fill / at its peak (snapshots included) | {res['indexer_rss_mb']:,.0f} MB "
        f"({res['bytes_per_entry']:.0f} B per entry) / {res.get('indexer_peak_mb', 0):,.0f} MB |",
        f"| bridge resident memory after the fill / at its peak | {res['bridge_rss_mb']:,.0f} MB / "
        f"{res.get('bridge_peak_mb', 0):,.0f} MB |",
        f"| snapshots written / size / write time | {res['snapshots']} / {res.get('snapshot_mb', '-')} MB / "
        f"{res.get('snapshot_write_s', '-')} s |",
        f"| ingest paused by a snapshot's table copy (mean) | {_ms(res['snapshot_ingest_pause_ms'])} |",
        f"| rolling update of every pod (restart, reset, refill) until all held again | {res['rolling_update_s']:.1f} s |",
        f"| discovery churn: every pod deleted from the API until the index is empty, then added back until "
        f"all is held again | {res['churn_removed_s']:.1f} s, {res['churn_back_s']:.1f} s |",
        f"| replica killed with SIGKILL: restart to ready (503s answered while loading) | "
        f"{res['restore_to_ready_s']:.1f} s ({res['readyz_503_while_loading']}) |",
    ]
    for phase, p in res["probe"].items():
        rows.append(f"| {phase}: probe p50 / p99 / max ({p['n']:,} requests) | {_ms(p['p50_ms'])} / "
                    f"{_ms(p['p99_ms'])} / {_ms(p['max_ms'])} |")
        lag = res["lag"].get(phase)
        if lag:
            rows.append(f"| {phase}: the replica's event loop: steps of its own work (CPU) / lag of its timers "
                        f"(wall) | {_loop(lag['step'])} / {_loop(lag['lag'])} |")
        lag = res.get("bridge_lag", {}).get(phase)
        if lag:
            rows.append(f"| {phase}: the bridge's event loop: steps / lag | {_loop(lag['step'])} / {_loop(lag['lag'])} |")
    return "\n".join(rows)
