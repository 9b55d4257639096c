"""Recorded trace batches sent one at a time at a fixed pace through ours and Dynamo's indexer side by side
(``python -m bench.paced``): each process's CPU and wake-ups a batch, and a quiet second's.

At 5x the trace's batches mostly come alone (one every 67 ms on average across the fleet), and that is
where issue 37's ingest mark is not met (bench/RESULTS.md, the trace section); ``bench.trace`` takes ten
minutes to show it among everything else. This sends the batches ``bench.bridge_alone record`` recorded
(perfect routing), one every ``--every-ms`` rather than at the trace's own times (which bunch them),
from 8 fake engines in vLLM's frames to the real bridge, nats-server and indexer replica and, on the same
engines at once, Dynamo's standalone indexer (where ``DYNAMO_PYTHON`` is set; in a loopback-only network
namespace, as it listens on every interface). Before that, with the engines connected and silent, it
measures a quiet second (``--idle``). A same-run ratio in about two minutes: an A/B for a change to the
lone batch's path.

    python -m bench.bridge_alone record --trace ../shared/traces/conversation_trace.jsonl --out /tmp/b2000.pkl
    DYNAMO_PYTHON=... python -m bench.paced --batches /tmp/b2000.pkl --every-ms 67 --limit 600 --idle 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import zmq.asyncio

from bench.common import free_port, machine, threads_cpu
from bench.dynamo import NETNS_ENV, dynamo_python, in_loopback_namespace
from bench.trace import LoggedDynamo, Ours, _cpu, _until, _wakeups
from bench.trace_engines import pod_host
from cache_indexer.simulate.vllm_engine import VllmPublisher

OURS = ("bridge", "indexer", "nats")


async def run(batches_file: str, every_ms: float, limit: int, idle: float, go_max_procs: int = 1) -> dict:
    data = pickle.load(open(batches_file, "rb"))
    batches = data["batches"][:limit] if limit else data["batches"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-paced-"))
    ctx = zmq.asyncio.Context()
    engines = [VllmPublisher(ctx, pod_host(i), free_port(), free_port(), buffer_steps=20_000)
               for i in range(data["engines"])]
    ours = Ours(tmp, [[e.host, e.pub_port, e.replay_port] for e in engines], 1, 16, go_max_procs)
    dynamo = None
    res: dict = {"batches": len(batches), "every_ms": every_ms, "machine": machine()}
    async with aiohttp.ClientSession() as session:
        try:
            await ours.start(session)
            if dynamo_python() and os.environ.get(NETNS_ENV) == "1":
                spec = ",".join(f"{i + 1}=tcp://{e.host}:{e.pub_port}" for i, e in enumerate(engines))
                dynamo = LoggedDynamo(tmp / "dynamo.log", block=16, workers=spec)
                await dynamo.start(session)
            for e in engines:  # each subscriber joined (XPUB reports every new subscription)
                for _ in range(2 if dynamo else 1):
                    await e.wait_subscribed(120)
            await asyncio.sleep(5.0)  # first contacts and the leases settle
            pids = {**ours.pids(), **({"dynamo": dynamo.proc.pid} if dynamo else {})}
            if idle:  # to the nanosecond (a quiet second is a few 10 ms ticks over a whole run)
                before = {k: threads_cpu(p) for k, p in pids.items()}
                await asyncio.sleep(idle)
                after = {k: threads_cpu(p) for k, p in pids.items()}
                res["idle_ms_per_s"] = {k: round((after[k][0] - before[k][0]) * 1e3 / idle, 3) for k in pids}
                res["idle_wakeups_per_s"] = {k: round((after[k][1] - before[k][1]) / idle, 1) for k in pids}
            c0, w0 = {k: _cpu(p) for k, p in pids.items()}, {k: _wakeups(p) for k, p in pids.items()}
            t0 = time.monotonic()
            for n, (_, wid, payload) in enumerate(batches):
                wait = t0 + n * every_ms / 1e3 - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await engines[wid].publish_payload(payload)

            async def published() -> bool:
                return await ours.published(session) >= len(batches)
            await _until(published, 120, 0.05, "every batch published")
            await asyncio.sleep(2.0)  # the replica's and Dynamo's last applies (both well under it)
            cpu = {k: _cpu(p) - c0[k] for k, p in pids.items()}
            res["ms_per_batch"] = {k: round(v * 1e3 / len(batches), 3) for k, v in cpu.items()}
            res["wakeups_per_batch"] = {k: round((_wakeups(p) - w0[k]) / len(batches), 2) for k, p in pids.items()}
            res["ours_s"] = round(sum(cpu[k] for k in OURS), 3)
            if dynamo:
                res["dynamo_s"] = round(cpu["dynamo"], 3)
                res["ratio"] = round(res["ours_s"] / cpu["dynamo"], 3)
        finally:
            ours.stop()
            if dynamo:
                dynamo.stop()
            for e in engines:
                await e.close()
            ctx.term()
    return res


def report(res: dict) -> str:
    names = [k for k in (*OURS, "dynamo") if k in res["ms_per_batch"]]
    rows = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
            "| CPU a batch (ms) | " + " | ".join(f"{res['ms_per_batch'][k]:.3f}" for k in names) + " |",
            "| wake-ups a batch | " + " | ".join(f"{res['wakeups_per_batch'][k]:.2f}" for k in names) + " |"]
    if "idle_ms_per_s" in res:
        rows += ["| quiet second: CPU (ms) | " + " | ".join(f"{res['idle_ms_per_s'][k]:.2f}" for k in names) + " |",
                 "| quiet second: wake-ups | " + " | ".join(f"{res['idle_wakeups_per_s'][k]:.1f}" for k in names) + " |"]
    line = f"{res['batches']} batches, one every {res['every_ms']:g} ms: ours {res['ours_s']:.2f} s"
    if "ratio" in res:
        line += f", Dynamo {res['dynamo_s']:.2f} s ({res['ratio']:.2f}x)"
    return "\n".join([line, "", *rows])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", required=True, help="recorded by python -m bench.bridge_alone record")
    ap.add_argument("--every-ms", type=float, default=67.0, help="one batch every this many ms (5x: 67)")
    ap.add_argument("--limit", type=int, default=600, help="the first N batches (0: all)")
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of a quiet fleet measured first (0: none)")
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args(argv)
    args = (os.path.abspath(a.batches), a.every_ms, a.limit, a.idle)
    if dynamo_python() and os.environ.get(NETNS_ENV) != "1":
        res = in_loopback_namespace(f"import asyncio, bench.paced as b; result = asyncio.run(b.run(*{args!r}))")
    else:
        res = asyncio.run(run(*args))
    print(report(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
