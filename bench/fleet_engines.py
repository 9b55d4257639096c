"""The engines of ``bench fleet``: ``--pods`` pods of ``--ranks`` data-parallel ranks each, in vLLM's
frames (``VllmPublisher``, one PUB and one replay socket per rank, as vLLM offsets its ports per rank),
driven by lines on stdin so that the benchmark times each phase:

- ``fill``: every rank stores a shared system prompt (real tokens, vLLM's hashes) and then its own
  blocks up to ``--blocks``, 64 a message; answered ``FILLED``;
- ``trickle``: from now on a single-block store every 0.1 s, over the pods (a fleet at rest still stores
  now and then, so snapshots keep coming due), until ``still``; answered ``TRICKLING``, ``STILL``;
- ``touch``: once the bridge has subscribed to every rank again, one single-block store on each (vLLM
  drops what it publishes before a subscriber joins); answered ``TOUCHED``;
- ``restart``: a rolling update: pod by pod, each rank restarts (seq from 0, an empty replay buffer:
  the bridge resets the worker, the indexer clears it) and fills again; answered ``RESTARTED``.

It writes the targets file (``--targets``) first and prints ``SUBSCRIBED`` once the bridge has joined
every socket.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

import yaml
import zmq.asyncio

from cache_indexer.simulate.vllm_engine import VllmPublisher, stored
from cache_indexer.schemas.block_hash import BlockHasher

BLOCK = 16
PROMPT_BLOCKS = 32  # the shared system prompt every rank holds (what the benchmark's probe asks about)
PER_MESSAGE = 64
PUB_PORT, REPLAY_PORT = 25557, 25657
HASHER = BlockHasher("sha256_cbor", "0")
PROMPT = [random.Random(99).randrange(1, 30_000) for _ in range(PROMPT_BLOCKS * BLOCK)]


def pod_host(i: int) -> str:
    return f"127.6.{i // 250}.{i % 250 + 1}"


async def _fill(eng: VllmPublisher, blocks: int, rng: random.Random) -> int:
    hashes = HASHER.event_hashes(PROMPT, BLOCK)
    await eng.publish([stored(hashes, block_size=BLOCK, token_ids=PROMPT)])
    n, parent = len(hashes), hashes[-1]
    while n < blocks:
        k = min(PER_MESSAGE, blocks - n)
        own = [rng.getrandbits(64) for _ in range(k)]
        await eng.publish([stored(own, parent=parent, block_size=BLOCK)])
        parent, n = own[-1], n + k
    return n


async def _trickle(engines: list[list[VllmPublisher]], rng: random.Random) -> None:
    i = 0
    while True:
        await engines[i % len(engines)][0].publish([stored([rng.getrandbits(64)], block_size=BLOCK)])
        i += 1
        await asyncio.sleep(0.1)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, required=True)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, required=True)
    ap.add_argument("--targets", required=True)
    args = ap.parse_args()
    ctx = zmq.asyncio.Context()
    ctx.max_sockets = 4 * args.pods * args.ranks + 64  # two a rank (libzmq's default stops at 1,023)
    engines: list[list[VllmPublisher]] = []
    targets = []
    for i in range(args.pods):  # each pod on its own loopback address, its ranks on port + r as vLLM does
        engines.append([VllmPublisher(ctx, pod_host(i), PUB_PORT + r, REPLAY_PORT + r, dp_rank=r, buffer_steps=10_000)
                        for r in range(args.ranks)])
        targets.append({"ip": pod_host(i), "zmqPort": PUB_PORT, "replayPort": REPLAY_PORT, "dpRanks": args.ranks})
    with open(args.targets, "w") as f:
        yaml.safe_dump({"vllm": targets}, f)
    await asyncio.gather(*(eng.wait_subscribed(300) for ranks in engines for eng in ranks))
    print("SUBSCRIBED", flush=True)
    rng = random.Random(1)
    trickling: asyncio.Task | None = None
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while line := (await reader.readline()).decode().strip():
        if line == "fill":
            n = 0
            for ranks in engines:
                for eng in ranks:
                    n += await _fill(eng, args.blocks, rng)
            print(f"FILLED {n}", flush=True)
        elif line == "trickle":  # a store now and then, over the pods: snapshots keep coming due
            trickling = asyncio.create_task(_trickle(engines, rng))
            print("TRICKLING", flush=True)
        elif line == "touch":  # one store on every rank once the bridge subscribed again (its first contact)
            await asyncio.gather(*(eng.wait_subscribed(600) for ranks in engines for eng in ranks))
            for ranks in engines:
                for eng in ranks:
                    await eng.publish([stored([rng.getrandbits(64)], block_size=BLOCK)])
            print("TOUCHED", flush=True)
        elif line == "still":
            trickling.cancel()
            await asyncio.gather(trickling, return_exceptions=True)
            print("STILL", flush=True)
        elif line == "restart":
            n = 0
            for ranks in engines:  # pod by pod, as a rolling update goes
                for eng in ranks:
                    eng.restart_engine()
                    n += await _fill(eng, args.blocks, rng)
            print(f"RESTARTED {n}", flush=True)
    for ranks in engines:
        for eng in ranks:
            await eng.close()
    ctx.term()


if __name__ == "__main__":
    asyncio.run(main())
