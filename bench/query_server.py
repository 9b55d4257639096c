"""A hit-rate API server over an L1 index with realistic contents, for bench/query.py.

The index holds ``--entries`` (block, worker) pairs: for each query shape, candidate pod i holds the
first (i+1)/C of the request's blocks (so the whole chain is hashed and every candidate's walk ends at
a different block), and the rest is random blocks spread over the pods. Prints ``PORT <n>`` when ready.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from api.app import HitRateApi
from api.server import HttpServer
from bench.shapes import SHAPES, pods, tokens_for
from infra.metrics import Metrics
from schemas.block_hash import BlockHasher
from indexer.l1_state import L1State
from schemas.config import HttpConfig


def build_index(entries: int, hasher: BlockHasher) -> L1State:
    state = L1State()
    seqs: dict[str, int] = {}

    def store(pod: str, hashes: list[int]) -> None:
        seq = seqs.get(pod, 0)
        state.apply({"type": "batch", "pod": pod, "rank": 0, "gen": 1, "seq": seq,
                     "events": [{"kind": "stored", "medium": "GPU", "hashes": hashes}]})
        seqs[pod] = seq + 1

    for shape in SHAPES:
        chain = hasher.event_hashes(tokens_for(shape), shape["block_size"])
        cands = pods(shape["candidates"])
        for i, pod in enumerate(cands):
            store(pod, chain[: len(chain) * (i + 1) // len(cands)])
    rng = random.Random(3)
    all_pods = pods(max(s["candidates"] for s in SHAPES))
    while state.index.entries() < entries:
        store(rng.choice(all_pods), [rng.getrandbits(64) for _ in range(1000)])
    return state


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    args = ap.parse_args()
    hasher = BlockHasher("sha256_cbor", "0")
    state = build_index(args.entries, hasher)
    http = HttpConfig(host="127.0.0.1", port=0, maxHitRateBodyBytes=16 << 20)
    api = HitRateApi(http, hasher, tiers=lambda: (state, None), ready=lambda: True, metrics=Metrics())
    server = HttpServer(api.make_app(), http)
    await server.start()
    print(f"PORT {server.port} ENTRIES {state.index.entries()}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
