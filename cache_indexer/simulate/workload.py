"""``cache-indexer simulate``: simulated vLLM engines, so a ratio above 0 can be seen without a GPU.

Each data-parallel rank of each simulated pod is a ``SimulatedEngine``: a model of vLLM's BlockPool
(cached blocks in LRU order under a block budget; a request reuses its longest cached prefix, evicts the
least recently used blocks it needs room for, and stores the rest) that turns requests into the KV
events vLLM emits, published in vLLM's exact ZMQ frames with a replay socket (``VllmPublisher``).
The traffic is what prefix caching is for: a few shared system prompts (prompt 0 is tokens 1..64, so
the printed curl is short) and multi-turn conversations that grow turn by turn, pinned to a rank.

The engines are listed in the targets overlay of the running ``cache-indexer local``
(``runtime_file.simulated_targets_path``), or in ``--targets FILE``; the file is removed on exit. With
``--register`` they register themselves over ``POST /register`` instead (instance ids sim-0, sim-1 ...)
and unregister on exit. ``--ask query`` checks the ratio and prints the curl with the ecosystem's
``POST /query`` (Dynamo's shape) instead of the seed's ``POST /kv-cache/hit-rate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cache_indexer import runtime_file
from cache_indexer.simulate.vllm_engine import VllmPublisher, batch_payload, cleared, removed, stored
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.schemas.config import Config

log = logging.getLogger(__name__)

DEMO_PROMPT = list(range(1, 65))  # system prompt 0: the one the printed curl asks about
VOCAB = 32000


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pods", type=int, default=3, help="simulated vLLM pods (default 3), IPs 127.0.1.1 ...")
    p.add_argument("--dp-ranks", type=int, default=2, help="data-parallel ranks per pod (default 2)")
    p.add_argument("--block-size", type=int, default=16, help="the engines' --block-size (default 16)")
    p.add_argument("--blocks", type=int, default=512, help="GPU blocks per rank: the eviction budget (default 512)")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second over all ranks (default 20)")
    p.add_argument("--duration", type=float, default=0.0, help="stop after this many seconds (default: at Ctrl-C)")
    p.add_argument("--seed", type=int, default=1, help="random seed of the traffic (default 1)")
    p.add_argument("--targets", metavar="FILE",
                   help="write the engines to this targets file instead of the running local instance's overlay")
    p.add_argument("--api", metavar="URL", help="the hit-rate API to check and print the curl for "
                   "(default: the running local instance's)")
    p.add_argument("--ask", choices=["hit-rate", "query"], default="hit-rate",
                   help="the API to check the ratio with and print the curl for: the seed's POST /kv-cache/hit-rate "
                        "(default) or the ecosystem's POST /query (Dynamo's standalone indexer's shape)")
    p.add_argument("--register", action="store_true",
                   help="register the engines over POST /register (and unregister them on exit) instead of "
                        "listing them in a targets file; the token: --token, $CACHE_INDEXER_HTTP__REGISTRATIONTOKEN, "
                        "or the running local instance's")
    p.add_argument("--token", help="the registration token (http.registrationToken of the instance)")
    p.add_argument("--model", default="default", help="the model name /register and /query carry (default: default)")


class SimulatedEngine:
    """One rank's BlockPool, reduced to what its KV events show: which block hashes are cached, in how
    many physical blocks (vLLM does not de-duplicate: blocks computed after a prefix miss are stored
    even when their hash is cached already, and each copy is evicted on its own)."""

    def __init__(self, publisher: VllmPublisher, hasher: BlockHasher, block_size: int, num_blocks: int) -> None:
        self.publisher = publisher
        self.hasher = hasher
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.cached: OrderedDict[int, int] = OrderedDict()  # hash -> physical copies, LRU first
        self.used = 0  # physical blocks cached
        self.stored = self.removed = 0

    def events_for(self, tokens: list[int], copies: int = 1) -> list[dict]:
        """Serve one request (prompt and output together): the events vLLM would emit, in order.
        ``copies`` > 1: the same prefix scheduled that many times before the first was cached, so each
        new block is cached (and later evicted) once per copy."""
        bs = self.block_size
        hashes = self.hasher.event_hashes(tokens, bs)[: self.num_blocks]
        hit = 0
        while hit < len(hashes) and hashes[hit] in self.cached:
            self.cached.move_to_end(hashes[hit])
            hit += 1
        new = hashes[hit:]
        events: list[dict] = []
        protected = set(hashes[:hit])
        evict: list[int] = []
        while self.used + len(new) * copies > self.num_blocks:  # one physical block at a time, LRU first
            h = next((h for h in self.cached if h not in protected), None)
            if h is None:
                break
            if self.cached[h] > 1:  # its other copy was freed later: it stays, more recently used
                self.cached[h] -= 1
                self.cached.move_to_end(h)
            else:
                del self.cached[h]
            evict.append(h)
            self.used -= 1
        if evict:
            events.append(removed(evict))
            self.removed += len(evict)
        for _ in range(copies if new else 0):
            for h in new:
                self.cached[h] = self.cached.get(h, 0) + 1
                self.cached.move_to_end(h)
            self.used += len(new)
            events.append(stored(new, parent=hashes[hit - 1] if hit else None, block_size=bs,
                                 token_ids=tokens[hit * bs: len(hashes) * bs]))
            self.stored += len(new)
        return events

    def clear(self) -> list[dict]:
        """vLLM's reset_prefix_cache: every cached block dropped, one AllBlocksCleared."""
        self.cached.clear()
        self.used = 0
        return [cleared()]

    async def serve(self, tokens: list[int]) -> None:
        events = self.events_for(tokens)
        if events:
            await self.publisher.publish_payload(batch_payload(events, self.publisher.dp_rank))


@dataclass
class Conversation:
    engine: SimulatedEngine
    tokens: list[int]
    turns_left: int
    rng: random.Random = field(repr=False, default_factory=random.Random)

    def next_turn(self) -> list[int]:
        """The user's next message and the model's answer: the history grows, its prefix stays."""
        self.tokens += [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(20, 120))]  # user
        self.tokens += [self.rng.randrange(VOCAB) for _ in range(self.rng.randint(30, 200))]  # answer
        self.turns_left -= 1
        return list(self.tokens)


class Workload:
    """Shared system prompts (prompt 0 most popular) and multi-turn conversations pinned to one rank."""

    def __init__(self, engines: list[SimulatedEngine], seed: int) -> None:
        self.rng = random.Random(seed)
        self.engines = engines
        self.prompts = [DEMO_PROMPT] + [[random.Random(seed * 100 + k).randrange(VOCAB) for _ in range(96 + 64 * k)]
                                        for k in range(1, 4)]
        self.weights = [8, 4, 2, 1]
        self.active: list[Conversation] = []
        self.requests = 0

    def _new_conversation(self) -> Conversation:
        prompt = self.rng.choices(self.prompts, self.weights)[0]
        return Conversation(self.rng.choice(self.engines), list(prompt), self.rng.randint(1, 6),
                            random.Random(self.rng.getrandbits(32)))

    async def step(self) -> None:
        if len(self.active) < 2 * len(self.engines) or self.rng.random() < 0.2:
            self.active.append(self._new_conversation())
        conv = self.rng.choice(self.active)
        await conv.engine.serve(conv.next_turn())
        self.requests += 1
        if conv.turns_left <= 0:
            self.active.remove(conv)


async def start_engines(pods: int, ranks: int, hasher: BlockHasher, block_size: int, blocks: int, ctx):
    """Bind each pod's ranks on consecutive ports (rank r on port + r), as the targets format expects."""
    import zmq

    engines, targets = [], []
    rng = random.Random()
    for i in range(pods):
        for _ in range(50):
            base = rng.randrange(20000, 60000 - 2 * ranks)
            pubs: list[VllmPublisher] = []
            try:
                for r in range(ranks):
                    pubs.append(VllmPublisher(ctx, "127.0.0.1", base + r, base + ranks + r, dp_rank=r))
                break
            except zmq.ZMQError:
                for pub in pubs:
                    await pub.close()
        else:
            raise RuntimeError("no free port range found for the simulated engines")
        engines += [SimulatedEngine(pub, hasher, block_size, blocks) for pub in pubs]
        targets.append({"ip": f"127.0.1.{i + 1}", "name": f"sim-{i}", "host": "127.0.0.1", "zmqPort": base,
                        "replayPort": base + ranks, "dpRanks": ranks})
    return engines, targets


def demo_request(pods: list[str], block_size: int) -> dict:
    return {"server_ip": pods, "body": {"token_ids": DEMO_PROMPT, "cache_salt": "", "block_size": block_size}}


def demo_query(block_size: int, model: str = "default") -> dict:
    """The same question in the ecosystem's shape (POST /query)."""
    return {"token_ids": DEMO_PROMPT, "model_name": model, "block_size": block_size}


def curl_line(api_url: str, request: dict, path: str = "/kv-cache/hit-rate") -> str:
    return f"curl -s {api_url}{path} -d '{json.dumps(request, separators=(', ', ': '))}'"


async def _ratios(session, api_url: str, request: dict, path: str) -> dict[str, float]:
    """Per pod (instance), the L1 ratio of the demo prompt, through either API."""
    async with session.post(f"{api_url}{path}", json=request) as resp:
        body = await resp.json(content_type=None)
    if path == "/query":
        return {pod: inst["gpu"] / len(DEMO_PROMPT) for pod, inst in (body.get("instances") or {}).items()}
    return {s["server_ip"]: s["l1_hit_ratio"] for s in body.get("server_score_list", [])}


def _registrations(targets: list[dict], args: argparse.Namespace) -> list[dict]:
    """The /register bodies of the simulated engines: one per rank, the pod's name as the instance id."""
    return [{"instance_id": t["name"], "dp_rank": r, "endpoint": f"tcp://{t['host']}:{t['zmqPort'] + r}",
             "replay_endpoint": f"tcp://{t['host']}:{t['replayPort'] + r}", "model_name": args.model,
             "block_size": args.block_size} for t in targets for r in range(t["dpRanks"])]


async def _register(session, api_url: str, token: str, bodies: list[dict], path: str = "/register") -> str | None:
    """POST each body; the first refusal's message, or None."""
    for body in bodies:
        async with session.post(f"{api_url}{path}", json=body, headers={"Authorization": f"Bearer {token}"}) as resp:
            if resp.status >= 300 and not (path == "/unregister" and resp.status == 404):
                return f"{path} {resp.status}: {(await resp.json(content_type=None)).get('error')}"
    return None


async def simulate(cfg: Config, args: argparse.Namespace, out=sys.stdout) -> int:
    import aiohttp
    import zmq.asyncio

    record = runtime_file.read_local()
    # The runtime record never holds the token (a secret): it comes from the flag or the environment.
    token = args.token or os.environ.get("CACHE_INDEXER_HTTP__REGISTRATIONTOKEN")
    if args.register:
        targets_path = None
        if not token:
            print("cache-indexer: --register needs the instance's registration token: --token TOKEN, or "
                  "$CACHE_INDEXER_HTTP__REGISTRATIONTOKEN (what `cache-indexer local` was given)", file=sys.stderr)
            return 2
        if record is None and not args.api:
            print("cache-indexer: no running `cache-indexer local` found; start it first, or pass --api URL",
                  file=sys.stderr)
            return 2
    elif args.targets:
        targets_path = Path(args.targets)
    elif record is not None:
        targets_path = runtime_file.simulated_targets_path()
    else:
        print("cache-indexer: no running `cache-indexer local` found; start it first, or pass --targets FILE "
              "(and --api URL) for a bridge of your own", file=sys.stderr)
        return 2
    api_url = args.api or (record or {}).get("api_url") or f"http://127.0.0.1:{cfg.http.port}"
    block_key = cfg.blockKey
    if record is not None and record.get("config") and not {"blockKey"} & cfg.model_fields_set:
        block_key = Config.model_validate(record["config"]).blockKey  # hash exactly as the instance expects
    hasher = BlockHasher.for_block_key(block_key)
    ctx = zmq.asyncio.Context()
    engines, targets = await start_engines(args.pods, args.dp_ranks, hasher, args.block_size, args.blocks, ctx)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with aiohttp.ClientSession() as session:
        if targets_path is not None:
            tmp = targets_path.with_suffix(".tmp")
            targets_path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(yaml.safe_dump({"vllm": targets}, sort_keys=False))
            tmp.replace(targets_path)
            pods, where = [t["ip"] for t in targets], f"targets in {targets_path}"
        else:
            refused = await _register(session, api_url, token, _registrations(targets, args))
            if refused:
                print(f"cache-indexer: registration refused: {refused}", file=sys.stderr)
                stop.set()
            pods, where = [t["name"] for t in targets], f"registered at {api_url}/register"
        print(f"simulating {args.pods} pods x {args.dp_ranks} ranks ({', '.join(pods)}), block size {args.block_size}, "
              f"{block_key.hashAlgo} seed {block_key.pythonHashSeed!r}; {where}", file=out, flush=True)
        workload = Workload(engines, args.seed)
        try:
            if not stop.is_set():
                await asyncio.wait_for(asyncio.gather(*(e.publisher.wait_subscribed(60) for e in engines)), 60)
        except asyncio.TimeoutError:
            print("cache-indexer: the bridge did not subscribe within 60s; is the instance watching "
                  f"{targets_path or 'its registrations'}?", file=sys.stderr)
            stop.set()
        path = "/query" if args.ask == "query" else "/kv-cache/hit-rate"
        request = demo_query(args.block_size, args.model) if args.ask == "query" else demo_request(pods, args.block_size)
        shown = False
        deadline = loop.time() + args.duration if args.duration else None
        next_report = loop.time() + 10
        while not stop.is_set() and (deadline is None or loop.time() < deadline):
            await workload.step()
            if not shown and workload.requests % 10 == 0:
                try:
                    ratios = await _ratios(session, api_url, request, path)
                except (aiohttp.ClientError, ValueError) as exc:
                    ratios = {}
                    log.debug("API not answering yet: %s", exc)
                if any(ratios.values()):
                    shown = True
                    print("L1 ratios of system prompt 0 now: " + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()),
                          file=out)
                    print("try it (another terminal):\n" + curl_line(api_url, request, path), file=out, flush=True)
            if loop.time() >= next_report:
                next_report += 10
                print(f"{workload.requests} requests, {sum(e.stored for e in engines)} blocks stored, "
                      f"{sum(e.removed for e in engines)} evicted", file=out, flush=True)
            try:
                await asyncio.wait_for(stop.wait(), 1 / args.rate)
            except asyncio.TimeoutError:
                pass
        if targets_path is None:
            refused = await _register(session, api_url, token, [{"instance_id": t["name"]} for t in targets],
                                      "/unregister")
            if refused:
                print(f"cache-indexer: {refused}", file=sys.stderr)
    if targets_path is not None:
        targets_path.unlink(missing_ok=True)
    for e in engines:
        await e.publisher.close()
    ctx.term()
    print(f"stopped after {workload.requests} requests; the engines were removed from "
          f"{targets_path or 'the registrations'}", file=out)
    return 0
