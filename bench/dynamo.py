"""Side by side with NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, PyPI
`ai-dynamo-runtime`, the optional `bench` extra; or a Python that has it in `DYNAMO_PYTHON`): the same
fake vLLM engines (own processes, vLLM's exact frames, chains with real token ids), the same prompts,
in one run, the two systems alternated, both asked through the same ``POST /query`` call (Dynamo's
standalone indexer's API, which cache-indexer speaks beside its seed API): one body, sent to each.

- Ingest: 4 engines publish chains of 32, 8 or 1 blocks per message as fast as they can; block events
  per second from the first publish until every engine's last chain answers as fully cached, and CPU
  seconds per 100k block events of each system's processes (ours: bridge, indexer, nats-server;
  engines excluded). Two runs each, alternated; the better one counts.
- Durability and memory: once more at 32 events per message, the index's process (ours: the indexer;
  Dynamo's only process) is killed with SIGKILL once everything is in and started again; the time
  until it answers as before. Its resident growth from ready to everything in, per entry.
- Query, three shapes (the issue's): N engines hold the first 1/N..N/N of one prompt (32k tokens, block
  size 16 and 128, 16 engines; 240k tokens, block size 64, 96 engines); both systems follow the same
  engines at once and answer the same query, alternately: p50/p99 of sequential queries, then requests
  per second with 16 concurrent connections. Both answers are checked exact.

Runs in a network namespace with only loopback (`unshare -n`; Dynamo listens on all interfaces).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import free_port, percentile
from bench.side_engines import BLOCK, chain_tokens, query_prompt
from cache_indexer.nats_server import NatsServer

ROOT = Path(__file__).resolve().parents[1]
INGEST_SHAPES = [(32, 2500), (8, 5000), (1, 20000)]  # (block events per message, messages per engine)
ENGINES = 4
#: how long a restarted index may take to answer as before kill -9
RECOVERY_WAIT = 30.0
#: set in the loopback-only network namespace the runs move into
NETNS_ENV = "BENCH_NETNS"
QUERY_SHAPES = [(16, 32768, 16), (16, 32768, 128), (96, 245760, 64)]  # (engines, prompt tokens, block size)


def query_body(tokens: list[int]) -> bytes:
    """The one /query both systems are asked (the engines' block size is each one's configuration)."""
    return json.dumps({"token_ids": tokens, "model_name": "default"}).encode()


def dynamo_python() -> str | None:
    if os.environ.get("DYNAMO_PYTHON"):
        return os.environ["DYNAMO_PYTHON"]
    return sys.executable if importlib.util.find_spec("dynamo") else None


def _cpu(pids: list[int]) -> float:
    """User + system CPU seconds of the processes (all their threads) so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError):
            pass
    return total / tick


def _spawn(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, **kw)


class Ours:
    name = "cache-indexer"

    def __init__(self, vllm: list[tuple[str, int, int]], block: int = BLOCK) -> None:
        self.block = block
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-side-"))
        (self.tmp / "targets.yaml").write_text("vllm:\n" + "".join(
            f"  - ip: {ip}\n    zmqPort: {pub}\n    replayPort: {rep}\n" for ip, pub, rep in vllm))
        self.port = free_port()
        self.nats = self.procs = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.nats = NatsServer().start()
        common = ["--set", f"nats.url={self.nats.url}", "--set", "log.level=warning", "--set", "http.host=127.0.0.1"]
        self._indexer_args = ["-m", "cache_indexer.cli", "indexer", *common, "--set", f"http.port={self.port}",
                              "--set", f"blockKey.blockSize={self.block}"]
        self.procs = [
            _spawn("-m", "cache_indexer.cli", "bridge", *common, "--set", f"discovery.static.file={self.tmp / 'targets.yaml'}",
                   "--set", f"http.port={free_port()}", "--set", "ingest.l1.blockKeyCheckInterval=0"),
            _spawn(*self._indexer_args)]
        await _until(lambda: _ok(session, "GET", f"http://127.0.0.1:{self.port}/readyz"), 60)

    def pids(self) -> list[int]:
        return [self.nats.proc.pid, *(p.pid for p in self.procs)]

    def index_pid(self) -> int:
        return self.procs[1].pid

    async def kill_index_and_restart(self, session: aiohttp.ClientSession) -> None:
        self.procs[1].kill()
        self.procs[1].wait()
        self.procs[1] = _spawn(*self._indexer_args)
        await _until(lambda: _ok(session, "GET", f"http://127.0.0.1:{self.port}/readyz"), 60)

    def request(self, pods: list[str], tokens: list[int]) -> tuple[str, bytes]:
        return f"http://127.0.0.1:{self.port}/query", query_body(tokens)

    def lengths(self, answer: dict, pods: list[str], tokens: list[int]) -> list[int]:
        instances = answer.get("instances") or {}
        return [(instances.get(pod) or {}).get("longest_matched", 0) for pod in pods]

    def stop(self) -> None:
        for p in self.procs or ():
            p.terminate()
        for p in self.procs or ():
            p.wait(20)
        if self.nats:
            self.nats.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class Dynamo:
    name = "Dynamo"

    def __init__(self, vllm: list[tuple[str, int, int]], block: int = BLOCK, workers: str | None = None,
                 python: str | None = None) -> None:
        """``workers``: Dynamo's own ``--workers`` spec ("id[:dp_rank]=tcp://host:port,..."); default:
        instance k+1 for the k-th of ``vllm``. ``python``: one with Dynamo (default ``dynamo_python()``)."""
        self.python = python or dynamo_python()
        self.vllm = vllm
        self.block = block
        self.workers = workers or ",".join(f"{k + 1}=tcp://{ip}:{pub}" for k, (ip, pub, _) in enumerate(vllm))
        self.port = free_port()
        self.proc = None

    async def start(self, session: aiohttp.ClientSession) -> None:
        workers = self.workers
        self.proc = subprocess.Popen([self.python, "-m", "dynamo.indexer", "--port", str(self.port), "--block-size",
                                      str(self.block), "--workers", workers], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await _until(lambda: _ok(session, "GET", f"http://127.0.0.1:{self.port}/workers"), 60)

    def pids(self) -> list[int]:
        return [self.proc.pid]

    def index_pid(self) -> int:
        return self.proc.pid

    async def kill_index_and_restart(self, session: aiohttp.ClientSession) -> None:
        self.proc.kill()
        self.proc.wait()
        await self.start(session)

    def request(self, pods: list[str], tokens: list[int]) -> tuple[str, bytes]:
        return f"http://127.0.0.1:{self.port}/query", query_body(tokens)

    def lengths(self, answer: dict, pods: list[str], tokens: list[int]) -> list[int]:
        instances = answer.get("instances") or {}
        ids = [str(k + 1) for k, (ip, _, _) in enumerate(self.vllm) if ip in pods]
        return [(instances.get(i) or {}).get("longest_matched", 0) for i in ids]

    def stop(self) -> None:
        if self.proc:
            self.proc.terminate()
            self.proc.wait(20)


async def full_lengths(system, session, pods: list[str], tokens: list[int], request=None) -> list[int]:
    """Cached tokens per pod, as the system answers (``request``: pre-encoded, so the client's own JSON
    encoding of a long prompt is not timed)."""
    url, body = request or system.request(pods, tokens)
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        return system.lengths(await r.json(), pods, tokens)


async def _ok(session, method: str, url: str) -> bool:
    try:
        async with session.request(method, url) as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def _until(predicate, timeout: float, every: float = 0.01) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(every)


def _read_ports(proc: subprocess.Popen) -> tuple[int, int]:
    _, pub, rep = proc.stdout.readline().split()
    return int(pub), int(rep)


def _rss(pid: int) -> int:
    """Resident bytes of a process."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def _ingest_once(kind, events: int, batches: int, recovery: bool = False) -> dict:
    """``recovery``: also kill -9 the process holding the index once everything is in, restart it, and
    time until it answers the same again (None: not within RECOVERY_WAIT)."""
    engines = [_spawn("-m", "bench.side_engines", "--mode", "ingest", "--host", f"127.0.2.{i + 1}", "--seed", str(i + 1),
                      "--events", str(events), "--batches", str(batches), stdout=subprocess.PIPE, text=True)
               for i in range(ENGINES)]
    vllm = [(f"127.0.2.{i + 1}", *_read_ports(p)) for i, p in enumerate(engines)]
    system = kind(vllm)
    finals = [chain_tokens(i + 1, batches - 1, events) for i in range(ENGINES)]
    try:
        async with aiohttp.ClientSession() as session:
            await system.start(session)
            rss0 = _rss(system.index_pid())
            starts = [float(p.stdout.readline().split()[1]) for p in engines]
            cpu0 = _cpu(system.pids())

            async def all_in() -> bool:
                for (ip, _, _), tokens in zip(vllm, finals):
                    if (await full_lengths(system, session, [ip], tokens)) != [len(tokens)]:
                        return False
                return True
            await _until(all_in, 600, every=0.005)
            done = time.time()
            cpu = _cpu(system.pids()) - cpu0
            rss = _rss(system.index_pid()) - rss0
            recovered = None
            if recovery:
                t = time.monotonic()
                await system.kill_index_and_restart(session)
                try:
                    await _until(all_in, RECOVERY_WAIT, every=0.05)
                    recovered = time.monotonic() - t
                except TimeoutError:
                    pass
    finally:
        system.stop()
        for p in engines:
            p.kill()
            p.wait()
    n = ENGINES * batches * events
    return {"rate": n / (done - min(starts)), "cpu_per_100k": cpu / n * 100_000, "bytes_per_entry": rss / n,
            "recovered_s": recovered}


async def _query_latency(system, session, pods, prompt, expected, n: int) -> list[float]:
    out = []
    request = system.request(pods, prompt)
    for i in range(n + 10):
        t = time.perf_counter()
        got = await full_lengths(system, session, pods, prompt, request)
        if i >= 10:
            out.append(time.perf_counter() - t)
        assert got == expected, f"{system.name} answered {got[:4]}..., expected {expected[:4]}..."
    return out


async def _throughput(system, pods, prompt, seconds: float = 5.0, conns: int = 16) -> float:
    done = 0
    stop = time.monotonic() + seconds
    request = system.request(pods, prompt)

    async def worker() -> None:
        nonlocal done
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < stop:
                await full_lengths(system, s, pods, prompt, request)
                done += 1
    t = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(conns)))
    return done / (time.monotonic() - t)


async def _query(n_pods: int, tokens: int, block: int) -> dict:
    engines = _spawn("-m", "bench.side_engines", "--mode", "query", "--pods", str(n_pods), "--tokens",
                     str(tokens), "--block-size", str(block), "--subscribers", "2", stdout=subprocess.PIPE, text=True)
    vllm = []
    for _ in range(n_pods):
        _, ip, pub, rep = engines.stdout.readline().split()
        vllm.append((ip, int(pub), int(rep)))
    pods = [ip for ip, _, _ in vllm]
    prompt = query_prompt(tokens, block)
    expected = [len(prompt) // block * (k + 1) // n_pods * block for k in range(n_pods)]
    systems = [Ours(vllm, block), Dynamo(vllm, block)]
    out: dict = {}
    try:
        async with aiohttp.ClientSession() as session:
            for s in systems:
                await s.start(session)
            assert engines.stdout.readline().strip() == "READY"
            for s in systems:
                await _until(lambda s=s: _equal(s, session, pods, prompt, expected), 120, every=0.05)
            lat = {s.name: [] for s in systems}
            for _ in range(4):  # alternated
                for s in systems:
                    lat[s.name] += await _query_latency(s, session, pods, prompt, expected, 50)
            for s in systems:
                out[s.name] = {"p50": percentile(lat[s.name], 50), "p99": percentile(lat[s.name], 99),
                               "rps": await _throughput(s, pods, prompt)}
    finally:
        for s in systems:
            s.stop()
        engines.kill()
        engines.wait()
    return out


async def _equal(system, session, pods, prompt, expected) -> bool:
    try:
        return await full_lengths(system, session, pods, prompt) == expected
    except (aiohttp.ClientError, KeyError, TypeError):
        return False


def _in_namespace(quick: bool, only: str | None = None) -> list[dict] | None:
    """Re-run this benchmark inside a loopback-only network namespace; None when already inside."""
    if os.environ.get(NETNS_ENV) == "1":
        return None
    return in_loopback_namespace(f"import bench.dynamo as d; result = d.run({quick}, {only!r})")


def in_loopback_namespace(code: str, timeout: float | None = None):
    """Runs Python ``code`` (which sets ``result``, JSON-able) in a new network namespace with only
    loopback up (``unshare -n``, or ``-rn`` without root): Dynamo listens on all interfaces."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        raise RuntimeError("needs unshare and ip (Dynamo listens on all interfaces: it runs in a loopback-only "
                           "network namespace)")
    wrapped = f"import json\n{code}\nprint('RESULT ' + json.dumps(result))"
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    r = subprocess.run([*unshare, "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"', sys.executable, wrapped],
                       cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, NETNS_ENV: "1", "PYTHONPATH": str(ROOT)})
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"run in a network namespace failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def run(quick: bool = False, only: str | None = None) -> list[dict]:
    """``only``: "ingest", "durability" or "query" (all three when None)."""
    if not dynamo_python():
        return [{"skipped": "Dynamo's indexer is not installed: pip install -e '.[bench]' (ai-dynamo-runtime), "
                            "or set DYNAMO_PYTHON to a Python that has it"}]
    inside = _in_namespace(quick, only)
    if inside is not None:
        return inside
    rows = []
    shapes = INGEST_SHAPES if not quick else [(8, 500)]
    for events, batches in shapes if only in (None, "ingest") else ():
        best: dict = {}
        for _ in range(1 if quick else 2):
            for kind in (Ours, Dynamo):
                r = asyncio.run(_ingest_once(kind, events, batches))
                if kind.name not in best or r["rate"] > best[kind.name]["rate"]:
                    best[kind.name] = r
        rows.append({"kind": "ingest", "events": events, **{f"{k}_{m}": v for k, r in best.items() for m, v in r.items()}})
    events, batches = shapes[0]
    if only in (None, "durability"):
        durable = {kind.name: asyncio.run(_ingest_once(kind, events, batches, recovery=True)) for kind in (Ours, Dynamo)}
        rows.append({"kind": "durability", "events": events, "entries": ENGINES * events * batches,
                     **{f"{k}_{m}": v for k, r in durable.items() for m, v in r.items()}})
    for pods, tokens, block in (QUERY_SHAPES if not quick else QUERY_SHAPES[:1]) if only in (None, "query") else ():
        q = asyncio.run(_query(pods, tokens, block))
        rows.append({"kind": "query", "shape": f"{tokens // 1024}k tokens, bs {block}, {pods} pods",
                     **{f"{k}_{m}": v for k, r in q.items() for m, v in r.items()}})
    return rows


def _recovered(seconds: float | None) -> str:
    return f"{seconds:.1f} s" if seconds is not None else f"not within {RECOVERY_WAIT:.0f} s"


def table(rows: list[dict]) -> str:
    if rows and "skipped" in rows[0]:
        return f"skipped: {rows[0]['skipped']}"
    o, d = "cache-indexer", "Dynamo"
    lines = ["| measure | cache-indexer | Dynamo | ratio (ours / Dynamo) |", "|---|---|---|---|"]
    for r in rows:
        if r["kind"] == "ingest":
            lines.append(f"| ingest, {ENGINES} engines, {r['events']} block events per message | {r[o + '_rate']:,.0f} ev/s | "
                         f"{r[d + '_rate']:,.0f} ev/s | {r[o + '_rate'] / r[d + '_rate']:.2f} |")
            lines.append(f"| CPU per 100k block events, {r['events']} per message | {r[o + '_cpu_per_100k']:.2f} s | "
                         f"{r[d + '_cpu_per_100k']:.2f} s | {r[o + '_cpu_per_100k'] / max(r[d + '_cpu_per_100k'], 1e-9):.1f}x |")
        elif r["kind"] == "durability":
            lines.append(f"| index memory per entry (resident growth of the index's process over {r['entries']:,} "
                         f"entries) | {r[o + '_bytes_per_entry']:.0f} B | {r[d + '_bytes_per_entry']:.0f} B | "
                         f"{r[o + '_bytes_per_entry'] / max(r[d + '_bytes_per_entry'], 1e-9):.2f} |")
            lines.append(f"| kill -9 of the index's process, restarted: same answers after | {_recovered(r[o + '_recovered_s'])} | "
                         f"{_recovered(r[d + '_recovered_s'])} | |")
        else:
            shape = r["shape"]
            lines.append(f"| query {shape}: p50 / p99 | {r[o + '_p50'] * 1e3:.2f} / {r[o + '_p99'] * 1e3:.2f} ms | "
                         f"{r[d + '_p50'] * 1e3:.2f} / {r[d + '_p99'] * 1e3:.2f} ms | "
                         f"{r[o + '_p50'] / r[d + '_p50']:.2f} / {r[o + '_p99'] / r[d + '_p99']:.2f} |")
            lines.append(f"| 16 concurrent connections, {shape} | {r[o + '_rps']:,.0f} req/s | {r[d + '_rps']:,.0f} req/s | "
                         f"{r[o + '_rps'] / r[d + '_rps']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    only = sys.argv[sys.argv.index("--only") + 1] if "--only" in sys.argv else None
    print(table(run(quick="--quick" in sys.argv, only=only)))
