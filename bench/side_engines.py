"""Fake vLLM engines for the side-by-side benchmark (bench/dynamo.py): chains with real token ids and
vLLM's hashes of them (sha256_cbor, seed "0"), so that this project (vLLM's hashes) and NVIDIA Dynamo's
indexer (its own hash of the token ids) both find them.

``--mode ingest``: one engine, ``--batches`` batches of one BlockStored of ``--events`` fresh blocks, as
fast as the socket takes them, once a subscriber per ``--subscribers`` has joined; prints its ports,
then the start time.
``--mode query``: ``--pods`` engines on 127.0.3.1.., engine k holding the first (k+1)/pods of one
prompt of ``--tokens`` tokens; prints each one's ports, then ``READY`` once all is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import zmq.asyncio

from cache_indexer.simulate.vllm_engine import VllmPublisher, batch_payload, stored
from cache_indexer.schemas.block_hash import BlockHasher

BLOCK = 16
HASHER = BlockHasher("sha256_cbor", "0")


def chain_tokens(seed: int, index: int, blocks: int, block_size: int = BLOCK) -> list[int]:
    rng = random.Random(seed * 1_000_003 + index)
    return [rng.randrange(1, 150_000) for _ in range(blocks * block_size)]


def chain_payload(tokens: list[int], block_size: int = BLOCK) -> bytes:
    return batch_payload([stored(HASHER.event_hashes(tokens, block_size), block_size=block_size, token_ids=tokens)])


def query_prompt(tokens: int, block_size: int) -> list[int]:
    return chain_tokens(7, 0, tokens // block_size, block_size)


async def _ingest(args) -> None:
    data = [chain_payload(chain_tokens(args.seed, i, args.events)) for i in range(args.batches)]
    ctx = zmq.asyncio.Context()
    eng = VllmPublisher(ctx, args.host, 0, 0, buffer_steps=args.batches + 1)
    print(f"PORTS {eng.pub_port} {eng.replay_port}", flush=True)
    for _ in range(args.subscribers):
        await eng.wait_subscribed(120)
    print(f"START {time.time()}", flush=True)
    for p in data:
        await eng.publish_payload(p)
    await asyncio.sleep(3600)  # keep the sockets up until killed


async def _query(args) -> None:
    prompt = query_prompt(args.tokens, args.block_size)
    hashes = HASHER.event_hashes(prompt, args.block_size)
    ctx = zmq.asyncio.Context()
    engines = [VllmPublisher(ctx, f"127.0.3.{k + 1}", 0, 0) for k in range(args.pods)]
    for k, eng in enumerate(engines):
        print(f"PORTS {eng.host} {eng.pub_port} {eng.replay_port}", flush=True)
    for eng in engines:
        for _ in range(args.subscribers):
            await eng.wait_subscribed(120)
    per_batch = 256  # blocks per batch, as a long prefill would send them
    for k, eng in enumerate(engines):
        n = len(hashes) * (k + 1) // args.pods
        for s in range(0, n, per_batch):
            e = min(n, s + per_batch)
            await eng.publish([stored(hashes[s:e], parent=hashes[s - 1] if s else None, block_size=args.block_size,
                                      token_ids=prompt[s * args.block_size:e * args.block_size])])
    print("READY", flush=True)
    await asyncio.sleep(3600)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ingest", "query"], required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--events", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--subscribers", type=int, default=1)
    ap.add_argument("--pods", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--block-size", type=int, default=BLOCK)
    args = ap.parse_args()
    asyncio.run(_ingest(args) if args.mode == "ingest" else _query(args))


if __name__ == "__main__":
    main()
