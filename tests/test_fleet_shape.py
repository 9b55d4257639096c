"""The native index at fleet shape (issue 35), end to end: 160 fake engines in vLLM's exact ZMQ frames
(135 pods, 25 of them with 2 data-parallel ranks), a bridge and an indexer replica as their own processes
and a real nats-server; the replica must survive the fleet and answer, over HTTP, exactly what the
engines hold.

Worker ids are interned once for all media (GPU, CPU, STORAGE) in order of first sight, and each
medium's native table grows its worker headers by doubling but its chunks (64 workers each) only to the
highest worker id it stored. A worker the registry knows but a table never stored for (interned through
the CPU offload medium, then removing GPU or STORAGE blocks it stored before the bridge subscribed) sits
past that table's last chunk once more than 64 workers exist. The fleet is brought up in phases, each
waited for (every engine of a phase stores the phase's marker block last; the next phase starts once the
replica shows all of them), so the ids fall where that matters, whatever the order within a phase:

1. 33 ranks first seen through the CPU medium (ids 0..32): 10 CPU-tier only (they never publish a GPU
   event) and 23 offloading engines whose very first event is a BlockRemoved of blocks never stored;
2. one GPU engine (id 33), which also offloads to STORAGE: the GPU and STORAGE tables' first worker,
   their headers 34;
3. 30 such engines (ids 34..63): the headers double to 68, the tables still have one chunk;
4. 4 offloading engines, removal first (ids 64..67): they store on the CPU, then remove GPU and STORAGE
   blocks never stored: past the only chunk of both tables;
5. 60 GPU (and STORAGE) engines (ids 68..127): headers 136, two chunks;
6. 6 offloading engines, removal first, and 2 CPU-only ones (ids 128..135): past the second chunk;
7. 24 more GPU engines, removal first (ids 136..159), and traffic on every engine: GPU, CPU and STORAGE
   stores, removals (of held and of never-held blocks), offloads (an offload store and a GPU removal in
   one batch) and AllBlocksCleared.

What a read past a table's chunks finds depends on the heap, so one such read need not crash (the GPU
table's first-chunk read alone let about one run in ten through): four of them (two tables, two chunks)
make the replica crash in every run seen; built with AddressSanitizer (.ci/native) it aborts at the first.

After each phase, for every document the fleet works on and every phase marker, both APIs must equal the
engines' own truth for every pod: ``POST /kv-cache/hit-rate`` (GPU ratio, best rank) and ``POST /query``
(per instance ``gpu``/``cpu``/``disk``/``dp``, and ``scores``). The replica must be alive throughout and
at the end. The seed is random per run and printed; ``FLEET_SHAPE_SEED`` replays it.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml
import zmq.asyncio

from cache_indexer.simulate.vllm_engine import VllmPublisher, cleared, removed, stored
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import http_ready, make_config, wait_for
from tests.test_local_mode import free_port
from tests.test_recovery import write_config

ROOT = Path(__file__).resolve().parents[1]
BS = 16
H = BlockHasher("sha256_cbor", "0")
DOC_BLOCKS = 8
DOCS = [[(d * 7907 + i * 31 + 11) % 60000 for i in range(DOC_BLOCKS * BS)] for d in range(16)]
CHAINS = [H.event_hashes(doc, BS) for doc in DOCS]
PHASES = 7
#: one block each: every engine of phase p stores MARKERS[p] last (CPU for those first seen through the CPU,
#: else GPU); the next phase waits until /query shows every one of them
MARKER_DOCS = [[70000 + p * BS + i for i in range(BS)] for p in range(PHASES + 1)]
MARKERS = [H.event_hashes(doc, BS)[0] for doc in MARKER_DOCS]
#: (phase, kind, ranks per pod, pods)
LAYOUT = [
    (1, "cpu_only", 1, 6), (1, "cpu_only", 2, 2), (1, "removal_first", 1, 9), (1, "removal_first", 2, 7),
    (2, "gpu", 1, 1),
    (3, "gpu", 1, 20), (3, "gpu", 2, 5),
    (4, "removal_first", 1, 2), (4, "removal_first", 2, 1),
    (5, "gpu", 1, 50), (5, "gpu", 2, 5),
    (6, "removal_first", 1, 4), (6, "removal_first", 2, 1), (6, "cpu_only", 1, 2),
    (7, "late_gpu", 1, 16), (7, "late_gpu", 2, 4),
]


def _ports_free(host: str, ports: list[int]) -> bool:
    socks = []
    try:
        for port in ports:
            s = socket.socket()
            socks.append(s)
            s.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for s in socks:
            s.close()


def _pod_ports(host: str, ranks: int) -> int:
    """A base port with ``2 * ranks`` free ports from it on ``host``: PUB at base + r, replay at
    base + ranks + r (rank r at zmqPort + r and replayPort + r, as vLLM offsets its ports)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + 2 * ranks < 65536 and _ports_free(host, list(range(base, base + 2 * ranks))):
            return base
    raise RuntimeError(f"no {2 * ranks} consecutive free ports on {host}")


class Rank:
    """One fake engine (a pod's DP rank) and the truth of what it holds, per medium."""

    def __init__(self, ctx, pod: str, rank: int, kind: str, phase: int, pub_port: int, replay_port: int) -> None:
        self.pod, self.rank, self.kind, self.phase = pod, rank, kind, phase
        self.pub = VllmPublisher(ctx, pod, pub_port, replay_port, dp_rank=rank)
        self.held = {"GPU": set(), "CPU": set(), "STORAGE": set()}

    async def store(self, hashes: list[int], medium: str) -> None:
        new = [h for h in dict.fromkeys(hashes) if h not in self.held[medium]]
        if new:
            self.held[medium].update(new)
            await self.pub.publish([stored(new, medium=medium, block_size=BS)])

    async def remove_never_stored(self, rng: random.Random, *media: str) -> None:
        """A BlockRemoved per medium of blocks the engine stored before anyone listened (never seen here)."""
        await self.pub.publish([removed([rng.getrandbits(64) | 1 for _ in range(rng.randrange(1, 4))], medium=medium)
                                for medium in media])

    async def step(self, rng: random.Random) -> None:
        """One batch of ordinary traffic."""
        chain = rng.choice(CHAINS)
        medium = "CPU" if self.kind == "cpu_only" else "GPU"
        r = rng.random()
        if r < 0.4:
            await self.store(chain[:rng.randrange(1, DOC_BLOCKS + 1)], medium)
        elif r < 0.6:
            held = [h for h in chain if h in self.held[medium]]
            gone = held[-rng.randrange(1, 4):] if held else []
            if gone:
                self.held[medium].difference_update(gone)
                await self.pub.publish([removed(gone, medium=medium)])
        elif self.kind == "cpu_only":
            held = [h for h in chain if h in self.held["CPU"]]
            if held:  # the CPU tier evicts from the middle too
                gone = rng.sample(held, 1)
                self.held["CPU"].difference_update(gone)
                await self.pub.publish([removed(gone, medium="CPU")])
        elif r < 0.8:  # offload: the connector stores on the CPU or STORAGE, the GPU evicts some of them
            tier = rng.choice(["CPU", "STORAGE"])
            on_gpu = [h for h in chain if h in self.held["GPU"]]
            out = [h for h in on_gpu if h not in self.held[tier]]
            if out:
                evict = out[-rng.randrange(1, len(out) + 1):]
                self.held[tier].update(out)
                self.held["GPU"].difference_update(evict)
                await self.pub.publish([stored(out, medium=tier, block_size=BS), removed(evict, medium="GPU")])
        elif r < 0.85:
            held = [h for h in chain if h in self.held["STORAGE"]]
            if held:
                gone = rng.sample(held, 1)
                self.held["STORAGE"].difference_update(gone)
                await self.pub.publish([removed(gone, medium="STORAGE")])
        elif r < 0.93:
            await self.remove_never_stored(rng, rng.choice(["GPU", "CPU", "STORAGE"]))
        else:  # AllBlocksCleared: the GPU's prefix cache reset; the offload tiers keep their blocks
            self.held["GPU"].clear()
            await self.pub.publish([cleared()])

    async def bring_up(self, rng: random.Random) -> None:
        """The engine's first batches, in its phase."""
        chain = rng.choice(CHAINS)
        if self.kind == "cpu_only":
            await self.store(chain[:rng.randrange(2, DOC_BLOCKS + 1)], "CPU")
        elif self.kind == "removal_first":
            await self.remove_never_stored(rng, "GPU")  # its very first event: unknown to the index yet
            await self.store(chain[:rng.randrange(2, DOC_BLOCKS + 1)], "CPU")  # first seen through the CPU
            await self.remove_never_stored(rng, "GPU", "STORAGE")  # tables that never stored for it
        elif self.kind == "late_gpu":
            await self.remove_never_stored(rng, "GPU")
            await self.store(chain[:rng.randrange(1, DOC_BLOCKS + 1)], "GPU")
        else:
            await self.store(chain[:rng.randrange(1, DOC_BLOCKS + 1)], "GPU")
            await self.store(chain[:rng.randrange(1, DOC_BLOCKS + 1)], "STORAGE")

    async def mark(self, phase: int) -> None:
        await self.store([MARKERS[phase]], "CPU" if self.kind in ("cpu_only", "removal_first") else "GPU")

    def levels(self, chain: list[int]) -> tuple[int, int, int]:
        """How vLLM would load the chain: (GPU blocks, where the CPU run from there ends, where the
        STORAGE run from there ends)."""
        ends, n = [], 0
        for medium in ("GPU", "CPU", "STORAGE"):
            held = self.held[medium]
            while n < len(chain) and chain[n] in held:
                n += 1
            ends.append(n)
        return ends[0], ends[1], ends[2]


def truth(ranks: list[Rank], pods: list[str], chain: list[int]) -> tuple[list[float], dict, dict]:
    """The seed API's ratios over ``pods``, and /query's ``instances`` and ``scores``."""
    per_pod: dict[str, dict[int, tuple[int, int, int]]] = {}
    for r in ranks:
        per_pod.setdefault(r.pod, {})[r.rank] = r.levels(chain)
    ratios = [max((lv[0] for lv in per_pod.get(pod, {}).values()), default=0) / len(chain) for pod in pods]
    instances, scores = {}, {}
    for pod, levels in per_pod.items():
        dp = {str(rank): g * BS for rank, (g, _, d) in levels.items() if d}
        if not dp:
            continue
        g, c, d = (max(lv[i] for lv in levels.values()) * BS for i in range(3))
        instances[pod] = {"longest_matched": d, "gpu": g, "dp": dp, "cpu": c, "disk": d, "l3": 0}
        if any(dp.values()):
            scores[pod] = {rank: n for rank, n in dp.items() if n}
    return ratios, instances, scores


class Replica:
    """The indexer replica's process, asked over HTTP; every question first checks it is alive."""

    def __init__(self, proc: subprocess.Popen, log: Path, session: aiohttp.ClientSession) -> None:
        self.proc, self.log, self.session = proc, log, session
        self.phase = 0

    def alive(self) -> None:
        rc = self.proc.poll()
        if rc is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the indexer replica exited with {rc} (negative: killed by that signal) in "
                                 f"phase {self.phase}; its stderr ends:\n{tail}")

    async def post(self, path: str, body: dict) -> dict:
        self.alive()
        try:
            async with self.session.post(path, json=body) as r:
                out = await r.json()
                assert r.status == 200, (path, r.status, out)
                return out
        except aiohttp.ClientError:  # a connection cut: the process died under the request?
            try:
                await asyncio.to_thread(self.proc.wait, 5)
            except subprocess.TimeoutExpired:
                pass
            self.alive()
            raise

    async def ratios(self, pods: list[str], tokens: list[int]) -> list[float]:
        body = {"server_ip": pods, "body": {"token_ids": tokens, "block_size": BS}}
        out = await self.post("/kv-cache/hit-rate", body)
        return [s["l1_hit_ratio"] for s in out["server_score_list"]]

    async def query(self, tokens: list[int]) -> dict:
        return await self.post("/query", {"token_ids": tokens, "model_name": "m", "block_size": BS})


async def test_a_fleet_of_160_engines_cpu_only_and_removal_first_ones_the_replica_survives_and_answers_truth(
        nats_url, stream_prefix, tmp_path):
    seed = int(os.environ.get("FLEET_SHAPE_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"FLEET_SHAPE_SEED={seed}")
    rng = random.Random(seed)
    ctx = zmq.asyncio.Context()
    ctx.max_sockets = 4096
    ranks: list[Rank] = []
    targets = []
    i = 0
    for phase, kind, n_ranks, n_pods in LAYOUT:
        for _ in range(n_pods):
            host = f"127.35.{i // 200}.{i % 200 + 1}"
            i += 1
            base = _pod_ports(host, n_ranks)
            for r in range(n_ranks):
                ranks.append(Rank(ctx, host, r, kind, phase, base + r, base + n_ranks + r))
            targets.append({"ip": host, "zmqPort": base, "replayPort": base + n_ranks, "dpRanks": n_ranks})
    pods = list(dict.fromkeys(r.pod for r in ranks))
    assert len(ranks) == 160 and len(pods) == 135
    sizes = {p: sum(r.phase == p for r in ranks) for p in range(1, PHASES + 1)}
    assert sizes == {1: 33, 2: 1, 3: 30, 4: 4, 5: 60, 6: 8, 7: 24}, sizes  # the worker ids of the docstring
    (tmp_path / "targets.yaml").write_text(yaml.safe_dump({"vllm": targets}))
    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"})
    api = free_port()
    bridge_cfg = write_config(cfg, tmp_path / "bridge.yaml", **{
        "discovery.static.file": str(tmp_path / "targets.yaml"), "http.port": free_port(),
        "ingest.l1.blockKeyCheckInterval": 0})  # placeholder tokens: not what the hashes were made of
    indexer_cfg = write_config(cfg, tmp_path / "indexer.yaml", **{"http.port": api})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    logs = {name: open(tmp_path / f"{name}.log", "w") for name in ("bridge", "indexer")}
    procs = {name: subprocess.Popen([sys.executable, "-X", "faulthandler", "-m", "cache_indexer.cli", name,
                                     "--config", str(path)], cwd=ROOT, env=env, stderr=logs[name])
             for name, path in (("indexer", indexer_cfg), ("bridge", bridge_cfg))}
    try:
        async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{api}") as session:
            replica = Replica(procs["indexer"], tmp_path / "indexer.log", session)

            async def ready() -> bool:
                replica.alive()
                return await http_ready(session, f"http://127.0.0.1:{api}/readyz")
            await wait_for(ready, 30, "the replica ready")
            for r in ranks:  # vLLM drops what it publishes before a subscriber joins
                await r.pub.wait_subscribed(60)

            async def marked(phase: int) -> set:
                out = await replica.query(MARKER_DOCS[phase])
                return {(pod, int(rank)) for pod, inst in out["instances"].items() for rank in inst["dp"]}

            async def agrees() -> bool:
                for tokens, chain in [*zip(DOCS, CHAINS), *zip(MARKER_DOCS, ([m] for m in MARKERS))]:
                    ratios, instances, scores = truth(ranks, pods, chain)
                    if await replica.ratios(pods, tokens) != ratios:
                        return False
                    out = await replica.query(tokens)
                    if out["instances"] != instances or out["scores"] != scores:
                        return False
                return True

            async def differences() -> list:
                diffs = []
                for tokens, chain in [*zip(DOCS, CHAINS), *zip(MARKER_DOCS, ([m] for m in MARKERS))]:
                    ratios, instances, scores = truth(ranks, pods, chain)
                    got = await replica.ratios(pods, tokens)
                    diffs += [("hit-rate", pod, g, w) for pod, g, w in zip(pods, got, ratios) if g != w]
                    out = await replica.query(tokens)
                    diffs += [("query", pod, out["instances"].get(pod), instances.get(pod))
                              for pod in set(out["instances"]) | set(instances)
                              if out["instances"].get(pod) != instances.get(pod)]
                return diffs[:10]

            for phase in range(1, PHASES + 1):
                replica.phase = phase
                mine = [r for r in ranks if r.phase == phase]
                for r in mine:
                    await r.bring_up(rng)
                if phase == PHASES:
                    for _ in range(3):
                        for r in rng.sample(ranks, len(ranks)):
                            await r.step(rng)
                    mine = ranks
                for r in mine:
                    await r.mark(phase)
                want = {(r.pod, r.rank) for r in mine}
                await wait_for(lambda: _equal(marked(phase), want), 30,
                               f"the replica to show phase {phase}'s {len(want)} engines (seed {seed})")
                try:
                    await wait_for(agrees, 15, f"the replica's answers to equal the engines' after phase {phase}")
                except AssertionError as exc:
                    replica.alive()
                    raise AssertionError(f"{exc} (seed {seed}); first differences (kind, pod, got, "
                                         f"truth): {await differences()}") from None
            # not vacuous: GPU hits on most pods, CPU and STORAGE runs past the GPU's on many, CPU-only
            # ranks among them
            gpu_pods = {r.pod for r in ranks for c in CHAINS if r.levels(c)[0]}
            cpu_past = {r.pod for r in ranks for c in CHAINS if r.levels(c)[1] > r.levels(c)[0]}
            disk_past = {r.pod for r in ranks for c in CHAINS if r.levels(c)[2] > r.levels(c)[1]}
            assert len(gpu_pods) > 80 and len(cpu_past) > 30 and len(disk_past) > 30, (
                len(gpu_pods), len(cpu_past), len(disk_past))
            cpu_only = {r.pod for r in ranks if r.kind == "cpu_only"}
            assert len(cpu_only & cpu_past) >= len(cpu_only) // 2, (cpu_only - cpu_past)
            replica.alive()
            async with session.get("/healthz") as r:
                assert r.status == 200
            assert procs["bridge"].poll() is None, "the bridge is alive"
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)
        for f in logs.values():
            f.close()
        for r in ranks:
            await r.pub.close()
        ctx.term()


async def _equal(value, want) -> bool:
    return await value == want
