"""The engines' sockets for ``bench trace``: ``--pods`` pods of ``--ranks`` data-parallel ranks, each rank a
``VllmPublisher`` (vLLM's exact frames: an XPUB and a replay ROUTER, rank r on the pod's ports + r, as
vLLM offsets them), on its own loopback address (127.8.x.y, from pod ``--first``). The fleet's model
(bench/trace_model.py) runs in the benchmark's process, which sends each batch here to be published:
a PAIR socket (``--control``, connected to the benchmark) carries ``[worker, msg id, payload]`` in and
``[msg id, CLOCK_MONOTONIC at the publish]`` back.

Prints ``PORTS <json: [[host, pub port, replay port], ...]>`` once bound, ``READY`` once every rank has
``--subscribers`` subscribers (vLLM drops what it publishes before then).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import struct
import time

import zmq
import zmq.asyncio

from cache_indexer.simulate.vllm_engine import VllmPublisher


def pod_host(i: int) -> str:
    return f"127.8.{i // 250}.{i % 250 + 1}"


#: below the range the benchmark's own listeners take theirs from (bench.common.free_port, 20000-32767) and
#: Linux's ephemeral range (32768-60999): Dynamo listens on every interface, so its port must not be an
#: engine's
PORT_RANGE = (10000, 20000)


def _bind_pod(ctx, host: str, ranks: int, rng: random.Random) -> list[VllmPublisher]:
    """The pod's ranks on consecutive ports (its PUB base + r and replay base + r), retried until free."""
    for _ in range(200):
        pub, rep = rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - ranks), rng.randrange(PORT_RANGE[0], PORT_RANGE[1] - ranks)
        if abs(pub - rep) < ranks:
            continue
        made: list[VllmPublisher] = []
        try:
            for r in range(ranks):
                made.append(VllmPublisher(ctx, host, pub + r, rep + r, dp_rank=r, buffer_steps=20_000))
            return made
        except zmq.ZMQError:
            for eng in made:
                eng.pub.close(0)
                eng.router.close(0)
                if eng._replay_task:
                    eng._replay_task.cancel()
    raise RuntimeError(f"no free ports for {host}")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pods", type=int, required=True)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--subscribers", type=int, default=1)
    ap.add_argument("--control", required=True)
    args = ap.parse_args()
    ctx = zmq.asyncio.Context()
    ctx.max_sockets = 4 * args.pods * args.ranks + 64
    rng = random.Random()
    engines: list[VllmPublisher] = []
    ports = []
    for i in range(args.first, args.first + args.pods):
        ranks = _bind_pod(ctx, pod_host(i), args.ranks, rng)
        engines += ranks
        ports.append([pod_host(i), ranks[0].pub_port, ranks[0].replay_port])
    print("PORTS " + json.dumps(ports), flush=True)
    await asyncio.gather(*(eng.wait_subscribed(600) for eng in engines for _ in range(args.subscribers)))
    control = ctx.socket(zmq.PAIR)
    control.setsockopt(zmq.LINGER, 0)
    control.connect(args.control)
    print("READY", flush=True)
    first = args.first * args.ranks
    pack = struct.Struct("<Qd").pack
    while True:
        frames = await control.recv_multipart(copy=False)
        if len(frames) == 1:  # the end
            break
        wid = int.from_bytes(frames[0].bytes, "little") - first
        payload = frames[2].bytes
        await engines[wid].publish_payload(payload)
        await control.send(pack(int.from_bytes(frames[1].bytes, "little"), time.monotonic()))
    for eng in engines:
        await eng.close()
    ctx.term()


if __name__ == "__main__":
    asyncio.run(main())
