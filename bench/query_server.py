"""A hit-rate API server over an L1 index with realistic contents, for bench/query.py.

The index holds ``--entries`` (block, worker) pairs: for each query shape, candidate pod i holds the
first (i+1)/C of the request's blocks (so the whole chain is hashed and every candidate's walk ends at
a different block), and the rest is random blocks spread over the pods. Prints ``PORT <n>`` when ready.
``--partition k/n``: only the pods of partition k (and 1/n of the entries), for bench/fanout.py.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import zlib

from cache_indexer.api.app import HitRateApi
from cache_indexer.api.server import HttpServer
from bench.shapes import SHAPES, pods, tokens_for
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.schemas.config import HttpConfig


def partition_of(pod: str, partitions: int) -> int:
    """The partition a pod's workers belong to when the index is split by worker (bench/fanout.py): a
    stable hash of its address, the same in every process."""
    return zlib.crc32(pod.encode()) % partitions


def build_index(entries: int, hasher: BlockHasher, part: tuple[int, int] = (0, 1)) -> L1State:
    """``part``: (k, n), the index of partition k of n: only its pods' blocks (and its share of entries)."""
    state = L1State()
    seqs: dict[str, int] = {}
    k, n = part

    def store(pod: str, hashes: list[int]) -> None:
        if partition_of(pod, n) != k:
            return
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
    while state.index.entries() < entries // n:
        store(rng.choice(all_pods), [rng.getrandbits(64) for _ in range(1000)])
    return state


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--partition", default="0/1", help="k/n: hold only partition k of n (by pod)")
    args = ap.parse_args()
    hasher = BlockHasher("sha256_cbor", "0")
    k, n = map(int, args.partition.split("/"))
    state = build_index(args.entries, hasher, (k, n))
    http = HttpConfig(host="127.0.0.1", port=0, maxHitRateBodyBytes=16 << 20)
    api = HitRateApi(http, hasher, tiers=lambda: (state, None), ready=lambda: True, metrics=Metrics())
    server = HttpServer(api.make_app(), http)
    await server.start()
    print(f"PORT {server.port} ENTRIES {state.index.entries()}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
