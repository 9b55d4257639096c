"""Past one replica's memory: the index split by worker over two partitions, a query fanned out to both.

Two servers (bench/query_server.py ``--partition k/2``) each hold the pods of their partition (a stable
hash of the pod address) and half of the other entries; a front (this module, ``--front``) takes the
router's request, sends each partition the same tokens with only its own candidates, and merges the
answers in the router's order. Each partition hashes the request's chain itself (the seed API carries
tokens, not block hashes). Against one server holding everything, alternately in one run: p50/p99 of
sequential requests and requests per second under 16 connections, 32k tokens, 16 candidates, bs 16.
A front over one server holding everything measures the hop alone. All the processes share this
machine's two cores: the partitions' duplicated hashing and the front's extra HTTP hop are what the
fan-out costs here; with a partition per node only the hop remains.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time

import aiohttp
import msgspec
from aiohttp import web

from bench.common import percentile
from bench.query_server import partition_of
from bench.shapes import SHAPES, pods, tokens_for
from cache_indexer.schemas.block_hash import find_token_ids

PARTITIONS = 2


def _body(shape: dict) -> bytes:
    return json.dumps({"server_ip": pods(shape["candidates"]),
                       "body": {"token_ids": tokens_for(shape), "block_size": shape["block_size"]}}).encode()


async def _front(ports: list[int]) -> None:
    """The fan-out: split the candidates by partition, ask every partition holding some, merge."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def ask(k: int, body: bytes) -> list[dict]:
        async with session.post(f"http://127.0.0.1:{ports[k]}/kv-cache/hit-rate", data=body,
                                headers={"Content-Type": "application/json"}) as r:
            return msgspec.json.decode(await r.read())["server_score_list"]

    async def hit_rate(request: web.Request) -> web.Response:
        raw = await request.read()
        start, stop = find_token_ids(raw)  # the tokens are passed on as they came, not parsed here
        envelope = msgspec.json.decode(raw[:start] + b"[]" + raw[stop:])
        tokens = raw[start:stop]
        groups: dict[int, list[str]] = {}
        for pod in envelope["server_ip"]:
            groups.setdefault(partition_of(pod, len(ports)), []).append(pod)
        bodies = {}
        for k, subset in groups.items():
            text = msgspec.json.encode({**envelope, "server_ip": subset})
            at = text.index(b'"token_ids":[]') + len(b'"token_ids":')
            bodies[k] = text[:at] + tokens + text[at + 2:]
        answers = await asyncio.gather(*(ask(k, b) for k, b in bodies.items()))
        by_pod = {item["server_ip"]: item for items in answers for item in items}
        merged = [by_pod[pod] for pod in envelope["server_ip"]]
        return web.Response(body=msgspec.json.encode({"status": 0, "message": "", "server_score_list": merged}),
                            content_type="application/json")

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/kv-cache/hit-rate", hit_rate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    print(f"PORT {site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def _spawn(*args: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline().split()[1])


async def _latency(port: int, body: bytes, n: int) -> tuple[list[float], list[dict]]:
    out, answer = [], None
    async with aiohttp.ClientSession() as s:
        for i in range(n + 10):
            t = time.perf_counter()
            async with s.post(f"http://127.0.0.1:{port}/kv-cache/hit-rate", data=body) as r:
                answer = (await r.json())["server_score_list"]
            if i >= 10:
                out.append(time.perf_counter() - t)
    return out, answer


async def _throughput(port: int, body: bytes, seconds: float, conns: int = 16) -> float:
    done, stop = 0, time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < stop:
                async with s.post(f"http://127.0.0.1:{port}/kv-cache/hit-rate", data=body) as r:
                    await r.read()
                done += 1
    t = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(conns)))
    return done / (time.monotonic() - t)


def run(quick: bool = False, entries: int = 1_000_000) -> dict:
    shape = SHAPES[0]
    body = _body(shape)
    procs = []
    try:
        single, single_port = _spawn("-m", "bench.query_server", "--entries", str(entries))
        procs.append(single)
        parts = []
        for k in range(PARTITIONS):
            proc, port = _spawn("-m", "bench.query_server", "--entries", str(entries), "--partition", f"{k}/{PARTITIONS}")
            procs.append(proc)
            parts.append(port)
        front, front_port = _spawn("-m", "bench.fanout", "--front", ",".join(map(str, parts)))
        hop, hop_port = _spawn("-m", "bench.fanout", "--front", str(single_port))  # the hop alone
        procs += [front, hop]
        ports = {"one server": single_port, "front + one server (the hop alone)": hop_port,
                 "front + 2 partitions": front_port}
        lat = {name: [] for name in ports}
        rps = {name: [] for name in ports}
        answers = {}
        for _ in range(2 if quick else 4):  # alternated
            for name, port in ports.items():
                got, answers[name] = asyncio.run(_latency(port, body, 20 if quick else 50))
                lat[name] += got
                rps[name].append(asyncio.run(_throughput(port, body, 1.5 if quick else 3)))
        assert all(a == answers["one server"] for a in answers.values()), "the merged answer differs"
        return {"shape": shape["name"], "entries": entries,
                "rows": {name: {"p50": percentile(lat[name], 50), "p99": percentile(lat[name], 99),
                                "rps": sorted(rps[name])[len(rps[name]) // 2]} for name in lat}}
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def table(res: dict) -> str:
    rows = res["rows"]
    one, fan = rows["one server"], rows["front + 2 partitions"]
    lines = [f"Query: {res['shape']}; {res['entries']:,} entries in all (each partition half); all processes on "
             "this machine's 2 cores.", "",
             "| setup | p50 | p99 | req/s, 16 connections (median of rounds) |", "|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['p50']*1e3:.2f} ms | {r['p99']*1e3:.2f} ms | {r['rps']:,.0f} |")
    hop = rows["front + one server (the hop alone)"]
    lines += ["", f"Fan-out cost: p50 +{(fan['p50'] - one['p50'])*1e3:.2f} ms ({fan['p50'] / one['p50']:.2f}x), "
              f"throughput {fan['rps'] / one['rps']:.2f}x of one server; of it the front's hop alone p50 "
              f"+{(hop['p50'] - one['p50'])*1e3:.2f} ms, throughput {hop['rps'] / one['rps']:.2f}x. The merged "
              "answers equal one server's."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--front", help="serve the fan-out front over these partition ports (comma-separated)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.front:
        asyncio.run(_front([int(p) for p in args.front.split(",")]))
    else:
        print(table(run(args.quick)))


if __name__ == "__main__":
    main()
