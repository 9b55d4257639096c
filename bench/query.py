"""Hit-rate query latency over HTTP on loopback, and throughput under concurrent load.

The server (bench/query_server.py) runs in its own process with a 1M-entry index; this process is
the client. Baseline, measured in the same run: the unavoidable work of the same query in pure
Python, i.e. ``json.loads`` of the body plus hashlib's sha256 over the chain's serialized bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
import time

import aiohttp

from bench.common import percentile, post_latencies, timeit
from bench.shapes import SHAPES, pods, tokens_for
from cache_indexer.schemas.block_hash import BlockHasher


def _body(shape: dict) -> bytes:
    return json.dumps({"server_ip": pods(shape["candidates"]),
                       "body": {"token_ids": tokens_for(shape), "cache_salt": "", "block_size": shape["block_size"]}}).encode()


def _baseline(shape: dict, body: bytes) -> float:
    h = BlockHasher("sha256_cbor", "0")
    toks, bs = tokens_for(shape), shape["block_size"]
    inputs, parent = [], h.none_hash
    for i in range(len(toks) // bs):
        data = h.serialize((parent, tuple(toks[i * bs:(i + 1) * bs]), None))
        inputs.append(data)
        parent = hashlib.sha256(data).digest()

    def work() -> None:
        json.loads(body)
        for b in inputs:
            hashlib.sha256(b).digest()
    s = sorted(timeit(work, 15))
    return s[len(s) // 2]


async def _latency(session: aiohttp.ClientSession, body: bytes, n: int) -> list[float]:
    return await post_latencies(session, "/kv-cache/hit-rate", [body], n, warmup=5)


async def _server_time(session: aiohttp.ClientSession) -> tuple[float, float]:
    """(sum, count) of the server's own handler-time histogram for successful hit-rate requests."""
    async with session.get("/metrics") as r:
        text = await r.text()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith('cache_indexer_http_request_duration_seconds_sum{path="/kv-cache/hit-rate",status="200"}'):
            total = float(line.rsplit(" ", 1)[1])
        if line.startswith('cache_indexer_http_request_duration_seconds_count{path="/kv-cache/hit-rate",status="200"}'):
            count = float(line.rsplit(" ", 1)[1])
    return total, count


async def _load(base: str, body: bytes, concurrency: int, seconds: float) -> tuple[int, list[float]]:
    lat: list[float] = []
    done = 0
    stop = time.perf_counter() + seconds

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.perf_counter() < stop:
            t = time.perf_counter()
            async with session.post("/kv-cache/hit-rate", data=body) as r:
                await r.read()
            lat.append(time.perf_counter() - t)
            done += 1

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(base_url=base, connector=conn) as session:
        start = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return int(done / elapsed), lat


async def _run(port: int, quick: bool) -> dict:
    base = f"http://127.0.0.1:{port}"
    rows = []
    async with aiohttp.ClientSession(base_url=base) as session:
        for shape in SHAPES:
            body = _body(shape)
            s0, c0 = await _server_time(session)
            lat = await _latency(session, body, 30 if quick else (100 if shape["tokens"] > 100000 else 300))
            s1, c1 = await _server_time(session)
            lat.sort()
            rows.append({"shape": shape["name"], "p50": percentile(lat, 50), "p99": percentile(lat, 99),
                         "server_mean": (s1 - s0) / max(1, c1 - c0),
                         "baseline": _baseline(shape, body), "target_p99_ms": shape["target_p99_ms"],
                         "body_kib": len(body) / 1024})
    load_body = _body(SHAPES[0])
    rps, lat = await _load(base, load_body, concurrency=16, seconds=3 if quick else 10)
    return {"latency": rows, "load": {"shape": SHAPES[0]["name"], "concurrency": 16, "rps": rps,
                                      "p50": percentile(lat, 50), "p99": percentile(lat, 99)}}


def run(quick: bool = False, entries: int = 1_000_000) -> dict:
    proc = subprocess.Popen([sys.executable, "-m", "bench.query_server", "--entries", str(entries)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        port, held = int(line[1]), int(line[3])
        res = asyncio.run(_run(port, quick))
        res["entries"] = held
        return res
    finally:
        proc.terminate()
        proc.wait(10)


def table(res: dict) -> str:
    lines = [f"Index: {res['entries']:,} (block, worker) entries; server and client in separate processes on loopback.", "",
             "| query | body | p50 | p99 | target p99 | server handler mean | baseline (json.loads + hashlib chain) |",
             "|---|---|---|---|---|---|---|"]
    for r in res["latency"]:
        tgt = f"{r['target_p99_ms']} ms {'met' if r['p99'] * 1e3 < r['target_p99_ms'] else 'MISSED'}" if r["target_p99_ms"] else "-"
        lines.append(f"| {r['shape']} | {r['body_kib']:.0f} KiB | {r['p50']*1e3:.2f} ms | {r['p99']*1e3:.2f} ms | {tgt} "
                     f"| {r['server_mean']*1e3:.2f} ms | {r['baseline']*1e3:.2f} ms |")
    ld = res["load"]
    lines += ["", f"Concurrent load ({ld['shape']}, {ld['concurrency']} connections from a second process): "
              f"**{ld['rps']} req/s**, latency p50 {ld['p50']*1e3:.1f} ms, p99 {ld['p99']*1e3:.1f} ms."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run(quick="--quick" in sys.argv)))
