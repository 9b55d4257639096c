"""The bridge alone on a trace's batches: its CPU per batch and when idle, without the rest of the fleet.

``python -m bench.trace`` measures every process at once, with the fleet's model, the indexer and Dynamo
competing for the same cores; this replays the vLLM batches that benchmark's engines publish under the
``perfect`` policy (recorded once from its model: ``record``) into a real bridge process (``run``), with
only a nats-server beside it, at the trace's own timing and speed. It prints the bridge's CPU over the
replay (user + system, per thread), its voluntary context switches (the times it slept and woke), and
with ``--idle S`` its CPU and wake-ups a second while 8 engines are connected and silent. ``--profile
FILE`` runs the bridge under cProfile over the replay only (not its start), for pstats.

    python -m bench.bridge_alone record --trace ../shared/traces/conversation_trace.jsonl --out /tmp/b2000.pkl
    python -m bench.bridge_alone run --batches /tmp/b2000.pkl --speed 5 --limit 1200 --idle 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import zmq.asyncio

from bench.common import free_port
from bench.trace import ROOT, Replay, _cpu, _get, _metric, _until, params
from bench.trace_engines import pod_host
from bench.trace_model import assign_loras, chain, load_trace
from cache_indexer.nats_server import NatsServer
from cache_indexer.simulate.vllm_engine import VllmPublisher, batch_payload

#: the bridge under cProfile, enabled by SIGUSR1 and written out by SIGUSR2 (the replay only)
_PROFILED = ("import cProfile, os, runpy, signal, sys\n"
             "p = cProfile.Profile()\n"
             "signal.signal(signal.SIGUSR1, lambda *_: p.enable())\n"
             "signal.signal(signal.SIGUSR2, lambda *_: (p.disable(), p.dump_stats(os.environ['BRIDGE_PROFILE'])))\n"
             "sys.argv = ['cache_indexer.cli'] + sys.argv[1:]\n"
             "runpy.run_module('cache_indexer.cli', run_name='__main__', alter_sys=True)\n")


def record(args) -> None:
    """The batches the trace's engines publish under perfect routing: (trace time, worker, payload)."""
    p = params(trace=args.trace, requests=args.requests, policies=["perfect"], dynamo=False, engines=args.engines)
    reqs, block_tokens = load_trace(p["trace"], p["requests"], p["format"])
    assign_loras(reqs, p["lora_share"], p["loras"])
    replay = Replay(p, "perfect", 1.0, reqs, block_tokens, False)
    fleet, out = replay.fleet, []

    def publish(adm, t: float) -> None:
        out.append((t, adm.wid, batch_payload(adm.events, dp_rank=fleet.workers[adm.wid].rank, ts=1e9 + t)))

    async def model() -> None:  # bench.trace.Replay._replay's order of events, without its clock
        i, now = 0, 0.0
        while i < len(reqs) or any(w.waiting for w in fleet.workers):
            nxt = reqs[i].at if i < len(reqs) else math.inf
            fin = fleet.next_finish()
            if fin is not None and fin <= nxt:
                if fleet.workers[fleet.finishing[0][2]].waiting:
                    now = max(now, fin)
                for adm in fleet.finish_next():
                    publish(adm, now)
                continue
            if fin is None and i >= len(reqs):
                break
            req = reqs[i]
            i += 1
            now = max(now, req.at)
            tokens = replay.tokens_of.prompt(req)
            hashes = chain(tokens, replay.bs, req.lora)
            adm = fleet.submit(await replay.decide(req, hashes, tokens), req, hashes, tokens, req.at)
            if adm is not None:
                publish(adm, now)
    asyncio.run(model())
    with open(args.out, "wb") as f:
        pickle.dump({"engines": args.engines, "batches": out}, f)
    print(f"{len(out)} batches, {sum(len(b[2]) for b in out) / 1e6:.1f} MB, {out[-1][0]:.0f} s of trace")


def _switches(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches"):
            return int(line.split(":")[1])
    return 0


def _threads(pid: int) -> dict[str, float]:
    out = {}
    for t in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (t / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[f"{stat[stat.index('(') + 1:stat.rindex(')')]}/{t.name}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


async def run(args) -> dict:
    data = pickle.load(open(args.batches, "rb"))
    batches = data["batches"][:args.limit] if args.limit else data["batches"]
    tmp = Path(tempfile.mkdtemp(prefix="bridge-alone-"))
    ctx = zmq.asyncio.Context()
    engines = [VllmPublisher(ctx, pod_host(i), free_port(), free_port(), buffer_steps=20_000) for i in range(data["engines"])]
    (tmp / "targets.yaml").write_text("vllm:\n" + "".join(
        f"  - ip: {e.host}\n    zmqPort: {e.pub_port}\n    replayPort: {e.replay_port}\n    dpRanks: 1\n" for e in engines))
    nats = NatsServer(store_dir=str(tmp / "nats")).start()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "cache_indexer.cli"]
    if args.profile:
        cmd, env["BRIDGE_PROFILE"] = [sys.executable, "-c", _PROFILED], args.profile
    cmd += ["bridge", "--set", f"nats.url={nats.url}", "--set", "log.level=warning", "--set", "http.host=127.0.0.1",
            "--set", f"discovery.static.file={tmp / 'targets.yaml'}", "--set", f"http.port={port}"]
    for s in args.set:
        cmd += ["--set", s]
    bridge = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=open(tmp / "bridge.log", "w"))
    res: dict = {}
    try:
        await asyncio.gather(*(e.wait_subscribed(120) for e in engines))
        async with aiohttp.ClientSession() as session:
            async def published() -> bool:
                text = await _get(session, f"http://127.0.0.1:{port}/metrics")
                return _metric(text, 'cache_indexer_bridge_batches_total{outcome="published"}') >= len(batches)
            await asyncio.sleep(2.0)  # first contacts settle
            if args.idle:
                c0, w0 = _cpu(bridge.pid), _switches(bridge.pid)
                await asyncio.sleep(args.idle)
                res["idle_cpu_per_61s"] = round((_cpu(bridge.pid) - c0) * 61 / args.idle, 3)
                res["idle_wakeups_per_s"] = round((_switches(bridge.pid) - w0) / args.idle, 1)
            c0, s0, w0, th0 = _cpu(bridge.pid), _cpu(bridge.pid, True), _switches(bridge.pid), _threads(bridge.pid)
            if args.profile:
                bridge.send_signal(signal.SIGUSR1)
            t0, first = time.monotonic(), batches[0][0]
            for t, wid, payload in batches:
                wait = t0 + (t - first) / args.speed - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await engines[wid].publish_payload(payload)
            res["replay_s"] = round(time.monotonic() - t0, 1)
            await _until(published, 120, 0.05, "every batch published")
            await asyncio.sleep(0.5)
            th1 = _threads(bridge.pid)
            res.update(batches=len(batches), bridge_cpu=round(_cpu(bridge.pid) - c0, 3),
                       bridge_system=round(_cpu(bridge.pid, True) - s0, 3), wakeups=_switches(bridge.pid) - w0,
                       threads={k: round(v - th0.get(k, 0.0), 3) for k, v in th1.items() if v - th0.get(k, 0.0) > 0.005})
            if args.profile:
                bridge.send_signal(signal.SIGUSR2)
                await asyncio.sleep(1.0)
    finally:
        bridge.send_signal(signal.SIGTERM)
        try:
            bridge.wait(30)
        except subprocess.TimeoutExpired:
            bridge.kill()
        for e in engines:
            await e.close()
        nats.close()
        ctx.term()
    print(json.dumps(res), flush=True)
    return res


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="record the batches of the trace's first N requests (perfect routing)")
    r.add_argument("--trace", required=True)
    r.add_argument("--requests", type=int, default=2000)
    r.add_argument("--engines", type=int, default=8)
    r.add_argument("--out", required=True)
    u = sub.add_parser("run", help="replay recorded batches into a bridge process")
    u.add_argument("--batches", required=True)
    u.add_argument("--speed", type=float, default=5.0)
    u.add_argument("--limit", type=int, default=0, help="the first N batches (default: all)")
    u.add_argument("--idle", type=float, default=0.0, help="seconds of idle measured before the replay")
    u.add_argument("--profile", metavar="FILE", help="cProfile of the bridge over the replay")
    u.add_argument("--set", action="append", default=[], help="a bridge setting (key=value), repeatable")
    args = ap.parse_args(argv)
    if args.cmd == "record":
        record(args)
    else:
        asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
