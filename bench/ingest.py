"""End-to-end ingest: fake vLLM engines (own process) -> ZMQ -> bridge (own process) -> JetStream
(nats-server) -> indexer (this process). Reported in block-events/s from the first publish to the
last event applied. Baseline in the same run: decoding and applying the same payloads in-process,
with no sockets and no JetStream (the Python work floor of the path).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.engine_proc import block_events, payloads
from cache_indexer.bridge.vllm_events import decode_batch
from cache_indexer.infra.config_loader import load_config
from cache_indexer.nats_server import NatsServer
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.service import Indexer

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds a live process has used (Linux /proc): a cost that a busy shared
    machine does not inflate the way it does wall time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _baseline(batches: int, events: int) -> float:
    data = payloads(batches, events, 1)
    state = L1State()
    t = time.perf_counter()
    for seq, p in enumerate(data):
        b = decode_batch(p)
        state.apply({"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": seq, "events": b.events})
    return block_events(data) / (time.perf_counter() - t)


async def _run(batches: int, events: int, engines: int, encoding: str = "msgpack") -> dict:
    # counted before anything runs: computed meanwhile, it held the indexer's event loop (this process)
    total = sum(block_events(payloads(batches // engines, events, i + 1)) for i in range(engines))
    server = NatsServer().start()
    tmp = tempfile.mkdtemp(prefix="bench-ingest-")
    procs = []
    try:
        engine_ports = []
        for i in range(engines):
            p = subprocess.Popen([sys.executable, "-m", "bench.engine_proc", "--host", f"127.0.2.{i + 1}",
                                  "--batches", str(batches // engines), "--events", str(events), "--seed", str(i + 1)],
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT)
            procs.append(p)
            engine_ports.append(p.stdout.readline().split()[1:])
        targets = Path(tmp) / "targets.yaml"
        targets.write_text("vllm:\n" + "".join(
            f"  - ip: 127.0.2.{i + 1}\n    zmqPort: {pub}\n    replayPort: {rep}\n"
            for i, (pub, rep) in enumerate(engine_ports)))
        overrides = [f"nats.url={server.url}", f"discovery.static.file={targets}", "log.level=warning",
                     f"nats.l1Stream.encoding={encoding}"]
        prof = ["-m", "cProfile", "-o", os.environ["BENCH_PROFILE_BRIDGE"]] if os.environ.get("BENCH_PROFILE_BRIDGE") else []
        bridge = subprocess.Popen([sys.executable, *prof, "-m", "cache_indexer.cli", "bridge", *sum((["--set", o] for o in overrides), [])],
                                  cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(bridge)
        cfg = load_config(env={}, overrides=overrides)
        indexer = Indexer(cfg)
        own_cpu = time.process_time()
        await indexer.start()
        starts = [float(p.stdout.readline().split()[1]) for p in procs[:engines]]
        deadline = time.time() + float(os.environ.get("BENCH_INGEST_TIMEOUT", "300"))
        while indexer.l1.stats.block_events < total and time.time() < deadline:
            await asyncio.sleep(0.005)
        done = time.time()
        own_cpu = time.process_time() - own_cpu
        bridge_cpu, server_cpu = cpu_seconds(bridge.pid), cpu_seconds(server.proc.pid)
        applied = indexer.l1.stats.block_events
        stream = await indexer.js.stream_info(cfg.nats.l1Stream.name)
        if applied < total:
            print(f"ingest bench: only {applied} of {total} block events applied; stats {indexer.l1.stats}",
                  file=sys.stderr)
        await indexer.stop()
        return {"batches": batches, "events_per_batch": events, "engines": engines, "block_events": applied,
                "seconds": done - min(starts), "rate": applied / (done - min(starts)), "encoding": encoding,
                "stream_bytes": stream.state.bytes, "messages": stream.state.messages, "bridge_cpu": bridge_cpu,
                "indexer_cpu": own_cpu, "server_cpu": server_cpu,
                "baseline_rate": _baseline(min(batches, 20000), events)}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.close()


def run(quick: bool = False) -> list[dict]:
    shapes = [(20000, 32, 4), (40000, 8, 4)] if not quick else [(4000, 32, 2)]
    return [asyncio.run(_run(b, e, n)) for b, e, n in shapes]


def table(rows: list[dict]) -> str:
    lines = ["| engines | batches | block events / batch | block events | seconds | end-to-end block-events/s "
             "| baseline: decode + apply in-process |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engines']} | {r['batches']:,} | {r['events_per_batch']} | {r['block_events']:,} | "
                     f"{r['seconds']:.2f} | **{r['rate']:,.0f}** | {r['baseline_rate']:,.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run(quick="--quick" in sys.argv)))
