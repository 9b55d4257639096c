"""A fake vLLM engine process for bench/ingest.py: waits for a subscriber, then publishes batches of
BlockStored/BlockRemoved events in vLLM's exact frames as fast as it can. Prints the start time."""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import zmq.asyncio

from cache_indexer.simulate.vllm_engine import VllmPublisher, batch_payload, removed, stored


def payloads(batches: int, events: int, seed: int) -> list[bytes]:
    """Each batch: one BlockStored of 3/4 of the events and one BlockRemoved of the rest (older blocks)."""
    rng = random.Random(seed)
    out, live = [], []
    oldest = 0  # live[oldest:] are held (slicing the list's head off each batch was quadratic)
    n_store = max(1, events * 3 // 4)
    for _ in range(batches):
        hs = [rng.getrandbits(64) for _ in range(n_store)]
        evs = [stored(hs, block_size=16)]
        live.extend(hs)
        n_rm = events - n_store
        if n_rm and len(live) - oldest > 10 * n_rm:
            evs.append(removed(live[oldest:oldest + n_rm]))
            oldest += n_rm
        out.append(batch_payload(evs))
    return out


def block_events(data: list[bytes]) -> int:
    """Block events in the payloads as the indexer counts them (one per hash)."""
    import msgpack

    return sum(len(e["block_hashes"]) for p in data for e in msgpack.unpackb(p)[1])


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--batches", type=int, required=True)
    ap.add_argument("--events", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    data = payloads(args.batches, args.events, args.seed)
    ctx = zmq.asyncio.Context()
    eng = VllmPublisher(ctx, args.host, 0, 0, buffer_steps=args.batches + 1)
    print(f"PORTS {eng.pub_port} {eng.replay_port}", flush=True)
    await eng.wait_subscribed(60)
    print(f"START {time.time()}", flush=True)
    for p in data:
        await eng.publish_payload(p)
    print(f"SENT {time.time()}", flush=True)
    await asyncio.sleep(3600)  # keep the replay socket up until killed


if __name__ == "__main__":
    asyncio.run(main())
