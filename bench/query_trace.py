"""Where the time of one trace-shaped ``/query`` goes, in process (``python -m bench.query_trace``).

The trace benchmark's routing query (bench/trace.py): a conversation-trace prompt (12k tokens on average,
about 70 kB of JSON) as ``{"token_ids": [...], "model_name": "default"}`` against an L1 index of 8 pods
holding the chains of the trace's earlier prompts. Timed stage by stage, each the median of many runs:
the body's decode (the accelerator finds the token array, msgspec reads the rest), the query's
preparation, the native call (the array's parse, sha256_cbor hashing of the chain as far as a candidate
holds it, the index walk; the parse alone; "memo warm": each body repeated, its digests remembered; the
worst case: every block held, no memo), the answer and its JSON; for reference what stdlib ``json`` would
take to read the body. Then over loopback HTTP, this process the client of an API served by a child
process: the round trip with the native call on the event loop and on the query threads (and Dynamo's,
``--dynamo``). ``--calibrate``: the native call's worst case per byte of JSON over token widths and block
sizes, which ``api/app.py``'s ``inline_cost`` bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import aiohttp

from bench.common import free_port, machine, percentile, post_latencies, threads_cpu
from bench.dynamo import NETNS_ENV, dynamo_python
from bench.trace_engines import pod_host
from bench.trace_model import Tokens, chain, load_trace
from cache_indexer.api.tiered_query import TieredQueryApi, answer, decode_query, native_answer
from cache_indexer.indexer.hit_rate import configure_native_query
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.tier_match import NativeTierQuery
from cache_indexer.schemas.block_hash import BlockHasher, find_token_ids, parse_token_array
from cache_indexer.schemas.config import HttpConfig

SAMPLE = "tests/data/traces/conversation_trace_sample.jsonl"
PODS = 8


def workload(trace: str, warm: int, queries: int, pods: int = PODS) -> tuple[L1State, list[bytes]]:
    """The index after ``warm`` requests (each prompt's chain stored on pod i % ``pods``, as round robin
    would), and the bodies of the ``queries`` requests after them."""
    reqs, block_tokens = load_trace(trace, warm + queries)
    tokens_of = Tokens(block_tokens)
    state = L1State()
    seqs = [0] * pods
    for i, req in enumerate(reqs[:warm]):
        pod = i % pods
        state.apply({"type": "batch", "pod": pod_host(pod), "rank": 0, "gen": 1, "seq": seqs[pod],
                     "events": [{"kind": "stored", "medium": "GPU", "hashes": chain(tokens_of.prompt(req), 16)}]})
        seqs[pod] += 1
    bodies = [f'{{"token_ids":[{",".join(map(str, tokens_of.prompt(r)))}],"model_name":"default"}}'.encode()
              for r in reqs[warm:]]
    return state, bodies


def _median_us(fn, bodies: list, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        for b in bodies:
            t = time.perf_counter()
            fn(b)
            out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e6


def stages(state: L1State, bodies: list[bytes], repeat: int) -> dict[str, float]:
    """Median microseconds of each stage over the bodies."""
    hasher = BlockHasher("sha256_cbor", "0")
    l1 = state

    def prepare(body: bytes):
        _, tj = decode_query(body)
        return NativeTierQuery.prepare(hasher, tj, 16, "", l1, None)
    prepared = {b: prepare(b) for b in bodies}
    outs = {b: prepared[b].native.run() for b in bodies}
    arrays = {}
    for b in bodies:
        _, tj = decode_query(b)
        from array import array
        a = array("Q")
        a.frombytes(parse_token_array(tj))
        arrays[b] = a

    def walk_array(b: bytes) -> None:  # hashing and walk from parsed tokens
        NativeTierQuery.prepare(hasher, arrays[b], 16, "", l1, None).native.run()

    route = TieredQueryApi(HttpConfig(), hasher, 16, lambda: (l1, None))

    def respond(b: bytes) -> None:
        import msgspec
        msgspec.json.encode(answer(prepared[b].result(outs[b]).only(lambda pod: True), 16))
    full = L1State()  # every block of every queried prompt held (on pod 0): the walk hashes the whole chain
    for seq, b in enumerate(bodies):
        full.apply({"type": "batch", "pod": pod_host(0), "rank": 0, "gen": 1, "seq": seq,
                    "events": [{"kind": "stored", "medium": "GPU", "hashes": hasher.event_hashes(arrays[b].tolist(), 16)}]})
    worst = {}

    def no_memo() -> None:  # a thread's memo is sized when it first queries: a fresh thread, memo off
        configure_native_query(0)
        worst["us"] = _median_us(lambda b: NativeTierQuery.prepare(hasher, decode_query(b)[1], 16, "", full,
                                                                   None).native.run(), bodies, repeat)
        configure_native_query(8 << 20)
    t = threading.Thread(target=no_memo)
    t.start()
    t.join()
    return {
        "body bytes (mean)": sum(map(len, bodies)) / len(bodies),
        "tokens (mean)": sum(o[0] for o in outs.values()) / len(outs),
        "find_token_ids": _median_us(lambda b: find_token_ids(b, True), bodies, repeat),
        "decode_query (find + msgspec envelope)": _median_us(decode_query, bodies, repeat),
        "stdlib json.loads of the body (reference)": _median_us(json.loads, bodies, max(1, repeat // 4)),
        "parse_token_array (native)": _median_us(lambda b: parse_token_array(decode_query(b)[1]), bodies, repeat),
        "NativeTierQuery.prepare": _median_us(lambda b: prepare(b), bodies, repeat),
        "native: hash + walk (parsed tokens, memo warm)": _median_us(walk_array, bodies, repeat),
        "native: parse + hash + walk (the call, memo warm)": _median_us(lambda b: prepared[b].native.run(), bodies, repeat),
        "worst: every block held, no memo (the call)": worst["us"],
        "answer + msgspec encode (Python)": _median_us(respond, bodies, repeat),
        "answer in one native pass": _median_us(lambda b: native_answer(prepared[b], outs[b], 16, None), bodies, repeat),
        "all of it on the loop (the route's answer_now)": _median_us(route.answer_now, bodies, repeat),
        **seed_answer_stages(state, bodies, repeat),
    }


def seed_answer_stages(state: L1State, bodies: list[bytes], repeat: int) -> dict[str, float]:
    """The seed API's answer where the router names every pod as a candidate (Hermes at fleet shape): the
    Python path (``NativeQuery.result``, then the body) and the one native pass (api/_answer_json.c)."""
    from cache_indexer.api import app as app_module
    from cache_indexer.api.app import HitRateApi
    from cache_indexer.indexer.hit_rate import NativeQuery
    from cache_indexer.infra.metrics import Metrics

    hasher = BlockHasher("sha256_cbor", "0")
    api = HitRateApi(HttpConfig(), hasher, tiers=lambda: (state, None), ready=lambda: True, metrics=Metrics())
    pods = list(state.workers.pods())
    queries = {b: NativeQuery.prepare(hasher, decode_query(b)[1], 16, "", pods, (state, None)) for b in bodies}
    outs = {b: q.run() for b, q in queries.items()}
    named = json.dumps(pods).encode()
    requests = [b'{"server_ip":' + named + b',"body":{"token_ids":' + bytes(decode_query(b)[1]) + b',"block_size":16}}'
                for b in bodies]
    out = {f"seed API request decode, {len(pods)} candidates": _median_us(api._decode, requests, repeat),
           f"seed API answer, {len(pods)} candidates: result + body (Python)":
           _median_us(lambda b: api._answer_body(queries[b].result(outs[b]), None), bodies, repeat)}
    if app_module._answer_json is not None:
        out[f"seed API answer, {len(pods)} candidates: one native pass"] = _median_us(
            lambda b: api._native_answer(queries[b], outs[b]), bodies, repeat)
    return out


def calibrate(repeat: int) -> list[tuple[str, int, int, int, float, float]]:
    """The native call's worst case (every block held, no memo) for prompts of one-digit, 16-bit and
    32-bit token ids at block sizes 1 to 256, and over candidates in 4 to 64 index chunks: (tokens, block
    size, chunks, body bytes, seconds, inline_cost's bound)."""
    import random

    from cache_indexer.api.app import inline_cost
    hasher, rng, out = BlockHasher("sha256_cbor", "0"), random.Random(1), []
    prompts = {"1-digit": [rng.randrange(10) for _ in range(30_000)],
               "16-bit": [rng.randrange(1 << 16) for _ in range(12_000)],
               "32-bit": [rng.randrange(1 << 32) for _ in range(8_000)]}

    def run() -> None:
        configure_native_query(0)
        for name, tokens in prompts.items():
            body = ('{"token_ids":[' + ",".join(map(str, tokens)) + '],"model_name":"m"}').encode()
            for bs in (1, 4, 16, 64, 256):
                state = L1State()
                state.apply({"type": "batch", "pod": "p", "rank": 0, "gen": 1, "seq": 0, "events": [
                    {"kind": "stored", "medium": "GPU", "hashes": hasher.event_hashes(tokens, bs)}]})
                query = NativeTierQuery.prepare(hasher, decode_query(body)[1], bs, "", state, None).native
                took = _median_us(lambda b: query.run(), [body], repeat) / 1e6  # (the call alone, as the bound)
                out.append((name, bs, 1, len(body), took, inline_cost(len(body), bs)))
        tokens = prompts["16-bit"]  # and over candidates in many index chunks (64 workers each)
        body = ('{"token_ids":[' + ",".join(map(str, tokens)) + '],"model_name":"m"}').encode()
        keys = hasher.event_hashes(tokens, 16)
        for chunks in (4, 16, 64):
            state = L1State()
            for w in range(64 * chunks):  # one worker a chunk holds the whole chain, the others a block
                state.apply({"type": "batch", "pod": f"p{w}", "rank": 0, "gen": 1, "seq": 0, "events": [
                    {"kind": "stored", "medium": "GPU", "hashes": keys if w % 64 == 0 else [w + 1]}]})
            query = NativeTierQuery.prepare(hasher, decode_query(body)[1], 16, "", state, None).native
            took = _median_us(lambda b: query.run(), [body], repeat) / 1e6
            out.append(("16-bit", 16, chunks, len(body), took, inline_cost(len(body), 16, chunks)))
    t = threading.Thread(target=run)  # a fresh thread: its memo sized (off) when it first queries
    t.start()
    t.join()
    configure_native_query(8 << 20)
    return out


async def _http(port: int, bodies: list[bytes], n: int, pace: float = 0.0, burst: int = 1) -> list[float]:
    async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
        return await post_latencies(session, "/query", bodies, n, warmup=20, pace=pace, burst=burst)


def _measure(port: int, pid: int, bodies: list[bytes], n: int,
             pace: float = 0.0, burst: int = 1) -> tuple[float, float, float, float]:
    """(p50 ms, p99 ms, server CPU us a query, its wake-ups a query) of ``n`` round trips one after the
    other (``burst`` at once), ``pace`` seconds apart, after 50 to warm up (the server's threads alive
    throughout)."""
    asyncio.run(_http(port, bodies, 50))
    cpu0, woke0 = threads_cpu(pid)
    lat = asyncio.run(_http(port, bodies, n, pace, burst))
    cpu1, woke1 = threads_cpu(pid)
    return (statistics.median(lat) * 1e3, percentile(lat, 99) * 1e3, (cpu1 - cpu0) / (n + 20) * 1e6,
            (woke1 - woke0) / (n + 20))


def http(trace: str, warm: int, queries: int, n: int, bodies: list[bytes],
         pace: float = 0.0, burst: int = 1) -> dict[str, tuple[float, float, float, float]]:
    """Ours with the native call on the query threads, and on the loop; Dynamo's where ``DYNAMO_PYTHON``
    is set and this runs in a loopback-only network namespace (``--dynamo``): its index empty (one
    silent worker), so its figure is its HTTP handling and hashing (ours walks a full index). ``pace``:
    the round trips that far apart, so that each finds the server asleep, as a router's do under a
    trace's load; ``burst``: that many at once, as the trace's arrivals come (about 9 in a millisecond)."""
    out = {}
    for inline in (0, 1):
        proc = subprocess.Popen([sys.executable, "-m", "bench.query_trace", "--serve", "--trace", trace,
                                 "--warm", str(warm), "--queries", str(queries), "--inline", str(inline)],
                                stdout=subprocess.PIPE, text=True)
        try:
            port = int(proc.stdout.readline().split()[1])
            out["ours, inline" if inline else "ours, query threads"] = _measure(port, proc.pid, bodies, n, pace,
                                                                                 burst)
        finally:
            proc.terminate()
            proc.wait(10)
    if os.environ.get(NETNS_ENV) == "1" and dynamo_python():
        port, silent = free_port(), free_port()
        proc = subprocess.Popen([dynamo_python(), "-m", "dynamo.indexer", "--port", str(port), "--block-size", "16",
                                 "--workers", f"1=tcp://127.0.0.1:{silent}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            asyncio.run(_up(port))
            out["Dynamo (empty index)"] = _measure(port, proc.pid, bodies, n, pace, burst)
        finally:
            proc.terminate()
            proc.wait(10)
    return out


async def _up(port: int) -> None:
    async with aiohttp.ClientSession() as session:
        for _ in range(600):
            try:
                async with session.get(f"http://127.0.0.1:{port}/workers") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("Dynamo's indexer did not come up")


async def serve(trace: str, warm: int, queries: int, inline: int) -> None:
    from cache_indexer.api import app as app_mod
    from cache_indexer.api.app import HitRateApi
    from cache_indexer.api.server import HttpServer
    from cache_indexer.infra.metrics import Metrics
    if inline == 0:  # every native call on the query threads
        app_mod.INLINE_BUDGET = -1
    elif inline == 1:  # every one on the loop
        app_mod.INLINE_BUDGET = float("inf")
    state, _ = workload(trace, warm, queries)
    http_cfg = HttpConfig(host="127.0.0.1", port=0, maxHitRateBodyBytes=16 << 20)
    api = HitRateApi(http_cfg, BlockHasher("sha256_cbor", "0"), tiers=lambda: (state, None), ready=lambda: True,
                     metrics=Metrics())
    server = HttpServer(api.make_app(), http_cfg)
    await server.start()
    print(f"PORT {server.port}", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=SAMPLE)
    ap.add_argument("--warm", type=int, default=500, help="requests whose chains the index holds")
    ap.add_argument("--queries", type=int, default=50, help="the requests after them, queried")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--pods", type=int, default=PODS, help="pods the warm requests are spread over (a /query "
                    "asks about every one)")
    ap.add_argument("--http", type=int, default=500, help="HTTP round trips a mode (0: none)")
    ap.add_argument("--pace-ms", type=float, default=0.0, help="the HTTP round trips this far apart (0: back to back)")
    ap.add_argument("--burst", type=int, default=1, help="HTTP round trips sent at once, each on its own connection")
    ap.add_argument("--dynamo", action="store_true", help="Dynamo's round trip too (DYNAMO_PYTHON; runs the "
                    "whole benchmark in a loopback-only network namespace: Dynamo listens on every interface)")
    ap.add_argument("--calibrate", action="store_true", help="the native call's worst case against inline_cost")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inline", type=int, default=2, help=argparse.SUPPRESS)  # 0 threads, 1 loop, 2 as configured
    a = ap.parse_args(argv)
    if a.serve:
        asyncio.run(serve(a.trace, a.warm, a.queries, a.inline))
        return 0
    if a.dynamo and os.environ.get(NETNS_ENV) != "1":
        unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
        return subprocess.call([*unshare, "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable, "-m",
                                "bench.query_trace", *argv], env={**os.environ, NETNS_ENV: "1"})
    if a.calibrate:
        for name, bs, chunks, size, took, bound in calibrate(a.repeat):
            print(f"{name:8s} block size {bs:4d}, {chunks:2d} chunks: {size:7,d} bytes, worst {took * 1e6:8.1f} us "
                  f"({took * 1e9 / size:5.2f} ns a byte), inline_cost {bound * 1e6:8.1f} us")
        return 0
    state, bodies = workload(a.trace, a.warm, a.queries, a.pods)
    print(f"# {machine()}; index: {state.index.entries():,} entries on {a.pods} pods; {len(bodies)} queries")
    for k, v in stages(state, bodies, a.repeat).items():
        print(f"{k:48s} {v:10.1f}" + ("" if "mean" in k else " us"))
    if a.http:
        for mode, (p50, p99, cpu, woke) in http(a.trace, a.warm, a.queries, a.http, bodies, a.pace_ms / 1e3,
                                                  a.burst).items():
            print(f"HTTP round trip, {mode:22s} p50 {p50:.3f} ms  p99 {p99:.3f} ms; server CPU {cpu:.0f} us and "
                  f"{woke:.2f} wake-ups a query")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
