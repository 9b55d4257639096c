"""cache-indexer and NVIDIA Dynamo's standalone indexer over the same fake vLLM engines, asked the same
requests through ``/query`` and ``/query_by_hash``, both checked against the engines' truth.

Engines (vLLM's frames over ZMQ, hashes from the project's hasher, sha256_cbor seed "0", tagged extra
keys as vLLM >= 0.31): instance 1 with two DP ranks (one socket each, as vLLM offsets the port per
rank), instances 2 and 3 with one. Each stores prefixes of plain and LoRA chains on the GPU in several
batches, offloads ranges to the CPU and to STORAGE (self-describing events, as ``self_describing_kv_events`` makes
them), evicts a few blocks from each; salted and multimodal chains use prompts of their own. Then one
GPU chain per worker, published last, tells when each system has applied everything.

Compared with Dynamo where it supports the feature (token and LoRA requests: ``longest_matched``,
``gpu``, ``dp``, ``cpu``); salted and multimodal requests, which Dynamo does not hash (it drops the
salt and the multimodal keys of events, so it also answers for salted chains as if they were plain),
and ``disk``, are checked against the truth only. ``/query_by_hash`` gets each system the hashes it
keys on: vLLM's to cache-indexer, Dynamo's XXH3 token hashes to Dynamo (plain requests).

Run by tests/test_ecosystem_api.py in a loopback-only network namespace (``run(seed)``).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
import random
import struct
import tempfile

import aiohttp
import xxhash

from bench.dynamo import Dynamo, _until
from cache_indexer.nats_server import NatsServer
from cache_indexer.simulate.vllm_engine import VllmPublisher, removed, stored
from cache_indexer.schemas.block_hash import BlockHasher, LoRAKey, MultiModalKey
from tests.conftest import make_config
from tests.l1_stack import L1Stack

BLOCK = 4
BLOCKS = 24  # a prompt's blocks
HASHER = BlockHasher("sha256_cbor", "0")
LORA = LoRAKey("adapter-a", "/loras/adapter-a")
SALT = "tenant-7"
MM = MultiModalKey("mm-5e1f", 6, 9)
WORKERS = [(1, 0), (1, 1), (2, 0), (3, 0)]  # (instance, DP rank)
MEDIA = ("GPU", "CPU", "STORAGE")
FIELDS = ("longest_matched", "gpu", "dp", "cpu", "disk")  # compared with Dynamo (``l3`` is ours alone)
PLAIN_PROMPTS, SALTED, MULTIMODAL = range(4), 4, 5


def host(instance: int) -> str:
    return f"127.0.4.{instance}"


def dynamo_local_hash(tokens: list[int]) -> int:
    """Dynamo's block hash of a token block (XXH3-64, seed 1337, little-endian u32s), as its i64."""
    v = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=1337)
    return v - (1 << 64) if v >= 1 << 63 else v


class Variant:
    """How a prompt's blocks are hashed: plain, LoRA, salted or multimodal."""

    def __init__(self, lora: LoRAKey | None = None, salt: str = "", mm: tuple[MultiModalKey, ...] = ()) -> None:
        self.lora, self.salt, self.mm = lora, salt, mm

    def hashes(self, tokens: list[int]) -> list[int]:
        return HASHER.event_hashes(tokens, BLOCK, cache_salt=self.salt or None, lora=self.lora, mm_features=self.mm)

    def extra_keys(self, start: int, stop: int) -> list:
        """The events' untagged extra keys of blocks [start, stop), as vLLM publishes them."""
        out = []
        for b in range(start, stop):
            keys = [self.lora.name] if self.lora else []
            keys += [m.identifier for m in self.mm if m.offset < (b + 1) * BLOCK and m.offset + m.length > b * BLOCK]
            keys += [self.salt] if self.salt and b == 0 else []
            out.append(keys or None)
        return out

    def body(self, tokens: list[int]) -> dict:
        body = {"token_ids": tokens, "model_name": "default"}
        if self.lora:
            body.update(lora_name=self.lora.name, lora_path=self.lora.path)
        if self.salt:
            body["cache_salt"] = self.salt
        if self.mm:
            body["mm_features"] = [{"identifier": m.identifier, "offset": m.offset, "length": m.length} for m in self.mm]
        return body


PLAIN, WITH_LORA = Variant(), Variant(lora=LORA)
SALTED_VARIANT, MM_VARIANT = Variant(salt=SALT), Variant(mm=(MM,))


class Truth:
    """What each worker holds, per medium, as the engines published it, and what vLLM would load of a
    request: the GPU's run from block 0, then the CPU's from there, then STORAGE's."""

    def __init__(self) -> None:
        #: per worker and medium, the copies of each hash (vLLM's BlockPool can cache one hash in two blocks,
        #: each evicted on its own; a fixed and a random history may store the same chain)
        self.held: dict[tuple[int, int], dict[str, Counter]] = {w: {m: Counter() for m in MEDIA} for w in WORKERS}
        #: hashes a removal left held because another copy was cached (Dynamo drops them at the first)
        self.kept_by_copy: set[int] = set()

    def remove(self, worker: tuple[int, int], medium: str, h: int) -> None:
        held = self.held[worker][medium]
        held[h] -= 1
        if held[h]:
            self.kept_by_copy.add(h)

    def answer(self, keys: list[int]) -> dict[str, dict]:
        """Dynamo's ``instances`` for a request with these block keys."""
        out: dict[str, dict] = {}
        for inst in sorted({i for i, _ in WORKERS}):
            ranks = {}
            for (i, rank), media in self.held.items():
                if i != inst:
                    continue
                media = {m: {h for h, n in held.items() if n > 0} for m, held in media.items()}
                gpu = _run(keys, media["GPU"])
                cpu = _run(keys, media["CPU"], gpu)
                ranks[rank] = (gpu, cpu, _run(keys, media["STORAGE"], cpu))
            if any(disk for _, _, disk in ranks.values()):
                gpu, cpu, disk = (max(levels[i] for levels in ranks.values()) * BLOCK for i in range(3))
                out[str(inst)] = {"longest_matched": disk, "gpu": gpu, "dp": {str(r): g * BLOCK for r, (g, _, d) in
                                                                             ranks.items() if d},
                                  "cpu": cpu, "disk": disk}
        return out


def _run(keys: list[int], held: set[int], n: int = 0) -> int:
    """Where the run of ``keys`` held from block ``n`` on ends."""
    while n < len(keys) and keys[n] in held:
        n += 1
    return n


#: Per instance, a history every run has (so that each case is exercised whatever the seed): prompt,
#: variant, and per rank the ranges stored per medium.
FIXED = {1: (0, PLAIN, {0: [(0, 6, "GPU")], 1: [(0, 12, "GPU")]}),  # two ranks at different depths
         2: (1, PLAIN, {0: [(0, 4, "GPU"), (4, 10, "CPU"), (10, 16, "STORAGE")]}),  # GPU, then CPU, then disk
         3: (2, WITH_LORA, {0: [(0, 8, "GPU"), (0, 8, "GPU")]})}  # two copies of each block: one eviction
#: keeps the block


async def _publish_worker(eng: VllmPublisher, truth: Truth, worker: tuple[int, int], prompts, seed: int) -> None:
    """The worker's history: its instance's fixed one, then GPU prefixes in batches, offloaded ranges and
    evictions over random prompts (an instance's ranks hold the same prompts, to different depths: a DP
    engine's ranks serve one model); then its marker chain."""
    held = truth.held[worker]
    p, variant, ranges = FIXED[worker[0]]
    hashes = variant.hashes(prompts[p])
    for a, z, medium in ranges.get(worker[1], ()):
        await eng.publish([_stored(variant, prompts[p], hashes, a, z, medium)])
        held[medium].update(hashes[a:z])
    if worker == (3, 0):
        await eng.publish([removed([hashes[3]])])
        truth.remove(worker, "GPU", hashes[3])
    rng = random.Random(f"{seed}-{worker}")
    for p in random.Random(f"{seed}-{worker[0]}").sample(range(len(prompts)), 4):
        variant = SALTED_VARIANT if p == SALTED else MM_VARIANT if p == MULTIMODAL else rng.choice([PLAIN, WITH_LORA])
        tokens = prompts[p]
        hashes = variant.hashes(tokens)
        gpu_end = rng.randint(1, BLOCKS)
        start = 0
        while start < gpu_end:  # in batches, each chained to the one before
            stop = min(gpu_end, start + rng.randint(1, 8))
            await eng.publish([_stored(variant, tokens, hashes, start, stop, "GPU")])
            held["GPU"].update(hashes[start:stop])
            start = stop
        end = gpu_end
        for medium in ("CPU", "STORAGE"):  # offloaded: a range from some block up to where the tier before
            if rng.random() < 0.7:         # ends (mostly), on past it
                a = rng.randint(max(0, end - 3), min(end, BLOCKS - 1)) if rng.random() < 0.8 else rng.randrange(BLOCKS)
                end = rng.randint(a + 1, BLOCKS)
                await eng.publish([_stored(variant, tokens, hashes, a, end, medium)])
                held[medium].update(hashes[a:end])
        for _ in range(rng.randint(0, 2)):  # evictions, from any medium
            medium = rng.choice(MEDIA)
            h = rng.choice(hashes)
            if held[medium][h]:
                await eng.publish([removed([h], medium=medium)])
                truth.remove(worker, medium, h)
    marker = _marker(worker)
    hashes = PLAIN.hashes(marker)
    await eng.publish([_stored(PLAIN, marker, hashes, 0, len(hashes), "GPU")])
    held["GPU"].update(hashes)


def _stored(variant: Variant, tokens: list[int], hashes: list[int], start: int, stop: int, medium: str) -> dict:
    ev = stored(hashes[start:stop], parent=hashes[start - 1] if start else None, medium=medium, block_size=BLOCK,
                token_ids=tokens[start * BLOCK:stop * BLOCK], lora_name=variant.lora.name if variant.lora else None)
    ev["extra_keys"] = variant.extra_keys(start, stop)
    return ev


def _marker(worker: tuple[int, int]) -> list[int]:
    rng = random.Random(f"marker-{worker}")
    return [rng.randrange(1, 30_000) for _ in range(2 * BLOCK)]


def _requests(prompts, rng: random.Random, n: int) -> list[tuple[Variant, list[int]]]:
    out = []
    for _ in range(n):
        p = rng.randrange(len(prompts))
        variant = SALTED_VARIANT if p == SALTED else MM_VARIANT if p == MULTIMODAL else rng.choice([PLAIN, WITH_LORA])
        length = rng.randint(0, BLOCKS * BLOCK + 3)
        tokens = list(prompts[p][:length])
        if tokens and rng.random() < 0.3:  # a request that goes its own way after some block
            k = rng.randrange(len(tokens))
            tokens[k:] = [rng.randrange(30_000, 40_000) for _ in tokens[k:]]
        if variant is MM_VARIANT and len(tokens) < MM.offset + MM.length:
            tokens = list(prompts[p][:MM.offset + MM.length])
        out.append((variant, tokens))
    return out


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        assert r.status == 200, f"{url}: {r.status} {text}"
        return json.loads(text)


def _ours_as_dynamo(answer: dict) -> dict:
    """Our instances keyed by Dynamo's instance ids (the engines' hosts here), without ``l3``."""
    ids = {host(i): str(i) for i, _ in WORKERS}
    return {ids[pod]: {k: v for k, v in inst.items() if k != "l3"} for pod, inst in answer["instances"].items()}


def _fields(instances: dict) -> dict:
    """The fields compared with Dynamo, per instance."""
    return {i: {f: inst[f] for f in FIELDS} for i, inst in instances.items()}


async def scenario(seed: int, dynamo_python: str | None, requests: int = 200) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 30_000) for _ in range(BLOCKS * BLOCK)] for _ in range(MULTIMODAL + 1)]
    nats = NatsServer(store_dir=tempfile.mkdtemp(prefix="side-nats-")).start()
    cfg = make_config(nats.url, f"side{seed}", blockKey={"pythonHashSeed": "0", "blockSize": BLOCK})
    stack = await L1Stack(cfg).start()
    truth = Truth()
    dynamo = None
    report = {"seed": seed, "requests": 0, "compared_with_dynamo": 0, "by_hash_compared": 0, "mismatches": [],
              "dynamo_wrong_where_unsupported": 0, "truth_only": 0,
              "covered": {"matched": 0, "cpu_beyond_gpu": 0, "disk_beyond_cpu": 0, "two_ranks": 0, "lora": 0,
                          "kept_by_copy": 0}}
    try:
        engines = {w: stack.engine(host(w[0]), dp_rank=w[1]) for w in WORKERS}
        await stack.connect(*((eng, host(w[0]), w[1]) for w, eng in engines.items()))
        async with aiohttp.ClientSession() as session:
            if dynamo_python:
                spec = ",".join(f"{i}{f':{r}' if r else ''}=tcp://{host(i)}:{engines[(i, r)].pub_port}" for i, r in WORKERS)
                dynamo = Dynamo([], block=BLOCK, workers=spec, python=dynamo_python)
                await dynamo.start(session)
                for eng in engines.values():  # Dynamo's subscription too
                    await eng.wait_subscribed(60)
            await asyncio.gather(*(_publish_worker(eng, truth, w, prompts, seed) for w, eng in engines.items()))
            ours = f"http://127.0.0.1:{stack.replica.http.port}"
            peers = [("cache-indexer", ours)] + ([("Dynamo", f"http://127.0.0.1:{dynamo.port}")] if dynamo else [])
            for name, base in peers:  # every worker's marker answered in full: everything before it is applied
                for w in WORKERS:
                    marker = _marker(w)

                    async def marked(base=base, marker=marker, w=w) -> bool:
                        got = (await _post(session, f"{base}/query", PLAIN.body(marker)))["instances"]
                        key = host(w[0]) if base == ours else str(w[0])
                        return (got.get(key) or {}).get("dp", {}).get(str(w[1])) == len(marker)
                    await _until(marked, 60)
            for variant, tokens in _requests(prompts, rng, requests):
                keys = variant.hashes(tokens)
                want = truth.answer(keys)
                _cover(report["covered"], want, variant)
                report["covered"]["kept_by_copy"] += bool(want) and bool(truth.kept_by_copy.intersection(keys))
                got = _ours_as_dynamo(await _post(session, f"{ours}/query", variant.body(tokens)))
                by_hash = _ours_as_dynamo(await _post(session, f"{ours}/query_by_hash",
                                                      {"block_hashes": keys, "model_name": "default"}))
                report["requests"] += 1
                for what, answer in (("/query", got), ("/query_by_hash", by_hash)):
                    if answer != want:
                        report["mismatches"].append({"system": "cache-indexer", "path": what, "tokens": len(tokens),
                                                     "variant": variant.body([]), "got": answer, "truth": want})
                if dynamo is None:
                    continue
                peer = (await _post(session, f"http://127.0.0.1:{dynamo.port}/query", variant.body(tokens)))["instances"]
                if variant.salt or variant.mm or truth.kept_by_copy.intersection(keys):
                    # not hashed by Dynamo, or held by a second copy of a block: the truth alone decides
                    report["truth_only"] += 1
                    report["dynamo_wrong_where_unsupported"] += _fields(peer) != _fields(want)
                    continue
                report["compared_with_dynamo"] += 1
                if _fields(peer) != _fields(got):
                    report["mismatches"].append({"system": "Dynamo /query", "tokens": len(tokens),
                                                 "variant": variant.body([]), "ours": got, "dynamo": peer})
                if variant is PLAIN:  # (no copy kept these blocks: checked above)
                    local = [dynamo_local_hash(tokens[b * BLOCK:(b + 1) * BLOCK]) for b in range(len(tokens) // BLOCK)]
                    peer_h = (await _post(session, f"http://127.0.0.1:{dynamo.port}/query_by_hash",
                                          {"block_hashes": local, "model_name": "default"}))["instances"]
                    report["by_hash_compared"] += 1
                    if _fields(peer_h) != _fields(by_hash):
                        report["mismatches"].append({"system": "Dynamo /query_by_hash", "tokens": len(tokens),
                                                     "ours": by_hash, "dynamo": peer_h})
    finally:
        if dynamo is not None:
            dynamo.stop()
        await stack.stop()
        nats.close()
    return report


def _cover(covered: dict, want: dict, variant: Variant) -> None:
    """What the truth of a request exercises (the test asserts each is seen)."""
    covered["matched"] += bool(want)
    covered["cpu_beyond_gpu"] += any(i["cpu"] > i["gpu"] for i in want.values())
    covered["disk_beyond_cpu"] += any(i["disk"] > i["cpu"] for i in want.values())
    covered["two_ranks"] += any(len([n for n in i["dp"].values() if n]) > 1 for i in want.values())
    covered["lora"] += bool(want) and variant.lora is not None


def run(seed: int, dynamo_python: str | None, requests: int = 200) -> dict:
    return asyncio.run(scenario(seed, dynamo_python, requests))
