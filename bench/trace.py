"""A trace-driven fleet: a public trace (Mooncake's format, or the Qwen Bailian layout) replayed at a chosen
speed through simulated vLLM engines whose caches follow vLLM's BlockPool (bench/trace_model.py: LRU free
queue, blocks of running requests pinned, evictions as BlockRemoved, optional CPU offload tier, DP
ranks, LoRA on a share of requests), publishing vLLM's exact frames (bench/trace_engines.py, a process
of their own) to the real bridge, nats-server and indexer (processes of their own), and NVIDIA Dynamo's
standalone indexer beside them where it is installed (``DYNAMO_PYTHON``; then everything runs in a
loopback-only network namespace). Each routing policy replays the same requests on a fresh fleet:

- ``round-robin``, ``least-load`` (fewest active blocks);
- ``kv-seed`` (the seed API, ``POST /kv-cache/hit-rate``, every pod a candidate), ``kv-query``
  (``POST /query``), ``dynamo`` (Dynamo's ``POST /query``), ``perfect`` (the engines' own truth): the
  worker of least cost, Dynamo's default: blocks to prefill (the prompt's full blocks less the hit the
  answer shows) plus the worker's active blocks (its running and queued requests', which the router
  knows from its own decisions: the same for every policy). Ties go to the lowest worker.

Reported per policy and speed: the fleet's prefix-hit rate (prompt tokens not computed: found on the
GPU or loaded from the CPU tier) and those tokens; agreement of each decision with perfect knowledge
(the chosen worker is one a router knowing the engines' caches at that moment would choose) and how
many answers were exact (what the answer said of every worker is what the truth says); freshness
(each BlockStored that lengthens a worker's run of a prompt: from the engine's publish until the
routed system answers the longer run, polled); routing-query latency (client round trip); CPU of
every process (/proc; ours: bridge, indexer, nats-server; Dynamo's one process; the engines' process;
the benchmark's own); and after each run the index against the engines' truth: a replica started in
this process from the stream compared entry by entry (every worker, GPU and CPU), and the answers of
the running systems for a sample of the prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import zmq
import zmq.asyncio

from bench.common import free_port, machine, percentile, threads_cpu
from bench.dynamo import Dynamo, dynamo_python
from bench.trace_engines import pod_host
from bench.trace_model import Fleet, Tokens, argmin, assign_loras, chain, cost, load_trace, lora_key
from cache_indexer.nats_server import NatsServer
from cache_indexer.schemas.chart_values import NatsChartValues
from cache_indexer.simulate.vllm_engine import batch_payload

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "traces" / "conversation_trace_sample.jsonl"
POLICIES = ["round-robin", "least-load", "kv-seed", "kv-query", "perfect", "dynamo"]
KV_POLICIES = {"kv-seed", "kv-query", "dynamo"}
NETNS_ENV = "BENCH_TRACE_NETNS"
PROBE_EVERY = 0.001  # between a probe's polls
PROBES_AT_ONCE = 1  # stores published while this many probes poll are not probed (bounds the probes' load)
PROBE_GIVE_UP = 30.0
DEFAULTS = {"trace": str(SAMPLE), "format": "auto", "requests": 500, "speeds": [20.0, 60.0], "engines": 8, "ranks": 1,
            "blocks_per_engine": 50_000, "block_size": 16, "cpu_blocks": 0, "lora_share": 0.0, "loras": 4,
            "prefill_tps": 10_000.0, "tpot": 0.03, "policies": None, "dynamo": None,
            "verify_requests": 200, "chart": None, "probe": True, "profile": None,
            "nats_go_max_procs": NatsChartValues.model_fields["goMaxProcs"].default}
QUICK = {"requests": 200, "speeds": [60.0]}


def _cpu(pid: int, system_only: bool = False) -> float:
    """User + system (or system only) CPU seconds of a process (all its threads) so far."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[12]) + (0 if system_only else int(fields[11]))) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError):
        return 0.0


def _wakeups(pid: int) -> int:
    """How often a process's threads have gone to sleep and been woken so far (voluntary context
    switches): at a slow replay every batch wakes each stage, and on a VM a Python process's wake-up
    costs 0.1-0.2 ms of CPU whatever the work (bench/RESULTS.md, the trace section)."""
    return threads_cpu(pid)[1]


def _spawn(args: list[str], log: Path | None = None, **kw) -> subprocess.Popen:
    err = open(log, "w") if log else None
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stderr=err, **kw)


async def _get(session: aiohttp.ClientSession, url: str) -> str | None:
    try:
        async with session.get(url) as r:
            return await r.text() if r.status == 200 else None
    except aiohttp.ClientError:
        return None


async def _until(predicate, timeout: float, every: float = 0.05, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"trace benchmark: {what} not reached within {timeout:.0f} s")
        await asyncio.sleep(every)


def _metric(text: str | None, name: str) -> float:
    total = 0.0
    for line in (text or "").splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Ours:
    """nats-server, a bridge and an indexer replica, each its own process, as the chart runs them."""

    def __init__(self, tmp: Path, ports: list[list], ranks: int, block_size: int, go_max_procs: int = 0) -> None:
        self.tmp = tmp
        #: nats-server's environment as the chart gives it (nats.goMaxProcs; 0: Go's own choice)
        self.nats_env = {"GOMAXPROCS": str(go_max_procs)} if go_max_procs else None
        (tmp / "targets.yaml").write_text("vllm:\n" + "".join(
            f"  - ip: {host}\n    zmqPort: {pub}\n    replayPort: {rep}\n    dpRanks: {ranks}\n" for host, pub, rep in ports))
        self.block_size = block_size
        self.port, self.bridge_port = free_port(), free_port()
        self.nats = None
        self.procs: dict[str, subprocess.Popen] = {}

    async def start(self, session: aiohttp.ClientSession) -> None:
        self.nats = NatsServer(store_dir=str(self.tmp / "nats"), env=self.nats_env).start()
        common = ["--set", f"nats.url={self.nats.url}", "--set", "log.level=warning", "--set", "http.host=127.0.0.1"]
        self.procs["bridge"] = _spawn(["-m", "cache_indexer.cli", "bridge", *common, "--set",
                                       f"discovery.static.file={self.tmp / 'targets.yaml'}", "--set",
                                       f"http.port={self.bridge_port}"], self.tmp / "bridge.log")
        self.procs["indexer"] = _spawn(["-m", "cache_indexer.cli", "indexer", *common, "--set", f"http.port={self.port}",
                                        "--set", f"blockKey.blockSize={self.block_size}"], self.tmp / "indexer.log")

        async def ready() -> bool:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"the {name} exited: {(self.tmp / (name + '.log')).read_text()[-2000:]}")
            return await _get(session, f"http://127.0.0.1:{self.port}/readyz") is not None
        await _until(ready, 60, what="the indexer ready")

    def pids(self) -> dict[str, int]:
        return {"bridge": self.procs["bridge"].pid, "indexer": self.procs["indexer"].pid, "nats": self.nats.proc.pid}

    async def nats_counts(self, session: aiohttp.ClientSession) -> dict[str, int]:
        """nats-server's message and byte counters (/varz): what our processes asked of it, and what it sent."""
        varz = json.loads(await _get(session, f"http://127.0.0.1:{self.nats.monitor_port}/varz") or "{}")
        return {k: int(varz.get(k, 0)) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}

    async def published(self, session: aiohttp.ClientSession) -> float:
        text = await _get(session, f"http://127.0.0.1:{self.bridge_port}/metrics")
        return _metric(text, 'cache_indexer_bridge_batches_total{outcome="published"}')

    def stop(self) -> None:
        for p in self.procs.values():
            p.terminate()
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.nats:
            self.nats.close()


class LoggedDynamo(Dynamo):
    """Dynamo's standalone indexer (bench/dynamo.py), its output kept in a log."""

    def __init__(self, log: Path, **kw) -> None:
        super().__init__([], **kw)
        self.log = log

    async def start(self, session: aiohttp.ClientSession) -> None:
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen([self.python, "-m", "dynamo.indexer", "--port", str(self.port), "--block-size",
                                          str(self.block), "--workers", self.workers], stdout=out, stderr=subprocess.STDOUT)

        async def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Dynamo's indexer exited (code {self.proc.returncode}): "
                                   f"{self.log.read_text()[-2000:]}")
            return await _get(session, f"http://127.0.0.1:{self.port}/workers") is not None
        await _until(up, 120, what="Dynamo's indexer up")


class Replay:
    """One policy at one speed on a fresh fleet."""

    def __init__(self, p: dict, policy: str, speed: float, requests, block_tokens: int, use_dynamo: bool) -> None:
        self.p, self.policy, self.speed, self.requests = p, policy, speed, requests
        self.use_dynamo = use_dynamo
        self.bs = p["block_size"]
        self.tokens_of = Tokens(block_tokens)
        self.pods = [pod_host(i) for i in range(p["engines"])]
        self.ranks = p["ranks"]
        self.go_max_procs = p["nats_go_max_procs"]
        self.fleet = Fleet(self.pods, self.ranks, p["blocks_per_engine"], self.bs, p["cpu_blocks"], p["prefill_tps"],
                           p["tpot"])
        self.pods_json = json.dumps(self.pods)
        self.out: dict = {"policy": policy, "speed": speed}
        self.lat: list[float] = []
        self.fresh: list[float] = []
        self.probe_timeouts = self.probe_superseded = self.probe_skipped = 0
        self.lag: list[float] = []
        self.agree = self.decisions = self.exact = self.answered = 0
        self.saved = self.prompt_tokens = 0
        self.msg = 0
        self.acked = 0
        self.pub_futs: dict[int, asyncio.Future] = {}
        self.probes: set[asyncio.Task] = set()
        self.rr = 0

    # -- bodies ------------------------------------------------------------------------------------
    def _lora(self, req) -> str:
        k = lora_key(req.lora)
        return f',"lora_name":"{k.name}","lora_path":"{k.path}"' if k else ""

    def seed_body(self, req, tokens_json: str, pods_json: str | None = None) -> bytes:
        return (f'{{"server_ip":{pods_json or self.pods_json},"body":{{"token_ids":[{tokens_json}],'
                f'"block_size":{self.bs}{self._lora(req)}}}}}').encode()

    def query_body(self, req, tokens_json: str) -> bytes:
        return f'{{"token_ids":[{tokens_json}],"model_name":"default"{self._lora(req)}}}'.encode()

    # -- what an answer says of each worker, in blocks -----------------------------------------------
    def view_seed(self, answer: dict, n: int) -> list[int]:
        ratio = {s["server_ip"]: s["l1_hit_ratio"] for s in answer["server_score_list"]}
        return [round(ratio.get(w.pod, 0.0) * n) for w in self.fleet.workers]

    def view_query(self, instances: dict, dynamo: bool) -> list[int]:
        bs, out = self.bs, []
        for w in self.fleet.workers:
            inst = instances.get(str(w.wid // self.ranks + 1) if dynamo else w.pod)
            if not inst:
                out.append(0)
                continue
            gpu = (inst.get("dp") or {}).get(str(w.rank), 0)
            # the CPU's run is the best rank's: taken as this rank's where it is the best on the GPU
            out.append((inst.get("cpu", gpu) if gpu == inst.get("gpu", 0) else gpu) // bs)
        return out

    def truth_view(self, hashes: list[int], seed: bool) -> list[int]:
        fleet = self.fleet
        gpu = fleet.gpu_runs(hashes)
        if seed:
            best: dict[str, int] = {}
            for w in fleet.workers:
                best[w.pod] = max(best.get(w.pod, 0), gpu[w.wid])
            return [best[w.pod] for w in fleet.workers]
        runs = fleet.loadable_runs(hashes, gpu)
        if self.ranks == 1:
            return runs
        out, by_pod = [], {}
        for w in fleet.workers:
            g, c = by_pod.get(w.pod, (0, 0))
            by_pod[w.pod] = (max(g, gpu[w.wid]), max(c, runs[w.wid]))
        for w in fleet.workers:
            g, c = by_pod[w.pod]
            out.append(c if gpu[w.wid] == g else gpu[w.wid])
        return out

    async def ask(self, req, tokens_json: str, n: int, system: str) -> list[int]:
        """The routing query of a KV policy; what it says of each worker."""
        if system == "kv-seed":
            url, body = f"{self.ours_url}/kv-cache/hit-rate", self.seed_body(req, tokens_json)
        else:
            url, body = f"{self.dynamo_url if system == 'dynamo' else self.ours_url}/query", self.query_body(req, tokens_json)
        t = time.perf_counter()
        async with self.session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status} {raw[:300]!r}")
        self.lat.append(time.perf_counter() - t)
        answer = json.loads(raw)
        if system == "kv-seed":
            return self.view_seed(answer, n)
        return self.view_query(answer.get("instances") or {}, system == "dynamo")

    # -- routing -----------------------------------------------------------------------------------
    async def decide(self, req, hashes: list[int], tokens) -> int:
        fleet = self.fleet
        n = len(hashes)
        load = [w.active_blocks for w in fleet.workers]
        truth_hits = fleet.loadable_runs(hashes)
        perfect = cost(n, truth_hits, load)
        policy = self.policy
        if policy == "round-robin":
            wid = self.rr % len(fleet.workers)
            self.rr += 1
        elif policy == "least-load":
            wid = argmin(load)
        elif policy == "perfect":
            wid = argmin(perfect)
        else:
            tokens_json = ",".join(map(str, tokens))
            hits = await self.ask(req, tokens_json, n, policy)
            self.answered += 1
            self.exact += hits == self.truth_view(hashes, policy == "kv-seed")
            wid = argmin(cost(n, hits, load))
        self.decisions += 1
        self.agree += perfect[wid] == min(perfect)
        return wid

    # -- publishing and freshness ------------------------------------------------------------------
    async def publish(self, adm, tokens) -> None:
        w = self.fleet.workers[adm.wid]
        self.msg += 1
        msg = self.msg
        payload = batch_payload(adm.events, dp_rank=w.rank)
        probe = (self.p["probe"] and self.policy in KV_POLICIES and adm.stored_run is not None
                 and len(self.probes) < PROBES_AT_ONCE)
        if self.p["probe"] and adm.stored_run is not None and self.policy in KV_POLICIES:
            self.probe_skipped += not probe
        if probe:
            self.pub_futs[msg] = asyncio.get_running_loop().create_future()
        await self.control.send_multipart([adm.wid.to_bytes(4, "little"), msg.to_bytes(8, "little"), payload])
        self.saved += adm.hit_blocks * self.bs
        self.prompt_tokens += adm.req.input_length
        if probe:
            task = asyncio.create_task(self._probe(adm, tokens, msg))
            self.probes.add(task)
            task.add_done_callback(self.probes.discard)

    async def _acks(self) -> None:
        unpack = struct.Struct("<Qd").unpack
        while True:
            msg, t = unpack(await self.control.recv())
            self.acked += 1
            fut = self.pub_futs.get(msg)
            if fut is not None and not fut.done():
                fut.set_result(t)

    async def _probe(self, adm, tokens, msg: int) -> None:
        """Polls the routed system until it answers the worker's longer run of the prompt."""
        w = self.fleet.workers[adm.wid]
        target = adm.stored_run[1]
        part = ",".join(map(str, tokens[:target * self.bs]))
        seed = self.policy == "kv-seed"
        if seed:
            url, body = f"{self.ours_url}/kv-cache/hit-rate", self.seed_body(adm.req, part, json.dumps([w.pod]))
        else:
            url = f"{self.dynamo_url if self.policy == 'dynamo' else self.ours_url}/query"
            body = self.query_body(adm.req, part)
        key = str(w.wid // self.ranks + 1) if self.policy == "dynamo" else w.pod
        start = time.monotonic()
        hashes = None
        while True:
            async with self.session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                answer = json.loads(await r.read())
            now = time.monotonic()
            if seed:
                got = round(answer["server_score_list"][0]["l1_hit_ratio"] * target)
            else:
                got = ((answer.get("instances") or {}).get(key) or {}).get("dp", {}).get(str(w.rank), 0) // self.bs
            if got >= target:
                break
            if now - start > PROBE_GIVE_UP:
                self.probe_timeouts += 1
                self.pub_futs.pop(msg, None)
                return
            if hashes is None:
                hashes = chain(tokens[:target * self.bs], self.bs, adm.req.lora)
            if self.fleet.run_on(w.wid, hashes) < target:  # evicted meanwhile (a request that finished at once)
                self.probe_superseded += 1
                self.pub_futs.pop(msg, None)
                return
            await asyncio.sleep(PROBE_EVERY)
        published = await self.pub_futs[msg]  # (the engines' ack may come after the answer)
        del self.pub_futs[msg]
        self.fresh.append(now - published)

    # -- the run -----------------------------------------------------------------------------------
    async def run(self) -> dict:
        p = self.p
        tmp = Path(tempfile.mkdtemp(prefix="bench-trace-"))
        ctx = zmq.asyncio.Context()
        self.control = ctx.socket(zmq.PAIR)
        self.control.setsockopt(zmq.LINGER, 0)
        control_port = self.control.bind_to_random_port("tcp://127.0.0.1")
        subscribers = 1 + self.use_dynamo
        hosts = [_spawn(["-m", "bench.trace_engines", "--pods", str(p["engines"]), "--ranks", str(self.ranks),
                         "--subscribers", str(subscribers), "--control", f"tcp://127.0.0.1:{control_port}"],
                        tmp / "engines-0.log", stdout=subprocess.PIPE, text=True)]
        ours = dynamo = None
        ack_task = None
        try:
            ports = []
            for h in hosts:
                line = await asyncio.to_thread(h.stdout.readline)
                if not line.startswith("PORTS "):
                    raise RuntimeError(f"the engines did not start: {(tmp / 'engines-0.log').read_text()[-2000:]}")
                ports += json.loads(line[6:])
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                self.session = session
                ours = Ours(tmp, ports, self.ranks, self.bs, self.go_max_procs)
                await ours.start(session)
                self.ours_url = f"http://127.0.0.1:{ours.port}"
                if self.use_dynamo:
                    spec = ",".join(f"{i + 1}{f':{r}' if r else ''}=tcp://{host}:{pub + r}"
                                    for i, (host, pub, _) in enumerate(ports) for r in range(self.ranks))
                    dynamo = LoggedDynamo(tmp / "dynamo.log", block=self.bs, workers=spec)
                    await dynamo.start(session)
                    self.dynamo_url = f"http://127.0.0.1:{dynamo.port}"
                ready = asyncio.ensure_future(asyncio.to_thread(hosts[0].stdout.readline))
                while not ready.done():  # every subscriber joined every engine; meanwhile, none of them died
                    await asyncio.wait([ready], timeout=1.0)
                    for name, proc in [*ours.procs.items(), *([("Dynamo", dynamo.proc)] if dynamo else [])]:
                        if proc.poll() is not None:
                            raise RuntimeError(f"{name} exited (code {proc.returncode}) before every engine had its "
                                               f"subscribers; its log: {tmp}")
                if ready.result().strip() != "READY":
                    raise RuntimeError(f"the engines were not subscribed: {(tmp / 'engines-0.log').read_text()[-2000:]}")
                ack_task = asyncio.create_task(self._acks())
                pids = {**ours.pids(), **({"dynamo": dynamo.proc.pid} if dynamo else {}), "engines": hosts[0].pid}
                spies = _spy(self.p.get("profile"), f"{self.policy}-{self.speed:g}x", pids)
                nats0 = await ours.nats_counts(session)
                cpu0 = {k: _cpu(pid) for k, pid in pids.items()}
                sys0 = {k: _cpu(pid, True) for k, pid in pids.items()}
                wake0 = {k: _wakeups(pid) for k, pid in pids.items()}
                me0 = os.times()
                t_wall = time.monotonic()
                await self._replay()
                _debug("replayed")
                await _until(lambda: _at_least(self.acked, self.msg), 120, 0.01, "every batch published")
                _debug("acked")
                await asyncio.gather(*list(self.probes))
                _debug("probed")
                await _until(lambda: _at_least_async(ours.published(session), self.msg), 300, 0.05,
                             "the bridge to publish every batch")
                _debug("bridge published")
                await asyncio.sleep(1.0)  # the indexer (and Dynamo) apply what is in flight
                cpu = {k: _cpu(pid) - cpu0[k] for k, pid in pids.items()}
                self.out["cpu_system"] = {k: _cpu(pid, True) - sys0[k] for k, pid in pids.items()}
                self.out["wakeups"] = {k: _wakeups(pid) - wake0[k] for k, pid in pids.items()}
                nats1 = await ours.nats_counts(session)  # (includes the metrics reads of the wait above)
                self.out["nats_counts"] = {k: nats1[k] - nats0[k] for k in nats0}
                me = os.times()
                _unspy(spies)
                cpu["benchmark"] = me.user + me.system - me0.user - me0.system
                self.out["wall_s"] = time.monotonic() - t_wall
                self.out["cpu"] = cpu
                self.out["verify"] = await self._verify(session, ours, dynamo)
        except BaseException:
            keep = True  # the processes' logs, for the error
            raise
        else:
            keep = False
        finally:
            if ack_task:
                ack_task.cancel()
            try:
                await self.control.send(b"end", zmq.NOBLOCK)  # (no peer yet where the engines never got ready)
            except zmq.ZMQError:
                pass
            for h in hosts:
                try:
                    h.wait(5)
                except subprocess.TimeoutExpired:
                    h.kill()
                    h.wait()
            if dynamo:
                dynamo.stop()
            if ours:
                ours.stop()
            _debug("stopped")
            self.control.close(0)
            ctx.term()
            if keep:
                print(f"trace: the run's logs are kept in {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
            _debug("cleaned up")
        f = self.fleet
        self.out.update({
            "requests": len(self.requests), "workers": len(f.workers),
            "hit_rate": self.saved / max(1, self.prompt_tokens), "saved_tokens": self.saved,
            "prompt_tokens": self.prompt_tokens, "agreement": self.agree / max(1, self.decisions),
            "decisions": self.decisions, "exact": self.exact, "answered": self.answered,
            "batches": self.msg, "stored_events": f.stored_events, "removed_events": f.removed_events,
            "fresh": _dist(self.fresh), "probes": len(self.fresh), "probe_timeouts": self.probe_timeouts,
            "probe_superseded": self.probe_superseded, "probe_skipped": self.probe_skipped, "query": _dist(self.lat), "lag": _dist(self.lag)})
        return self.out

    async def _replay(self) -> None:
        fleet, reqs, speed = self.fleet, self.requests, self.speed
        start = time.monotonic() + 0.1
        i = 0

        async def at(t: float) -> float:
            due = start + t / speed
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            return time.monotonic() - due
        while i < len(reqs) or any(w.waiting for w in fleet.workers):
            nxt = reqs[i].at if i < len(reqs) else math.inf
            fin = fleet.next_finish()
            if fin is not None and fin <= nxt:
                wid = fleet.finishing[0][2]
                if fleet.workers[wid].waiting:
                    await at(fin)
                for adm in fleet.finish_next():
                    await self.publish(adm, adm.tokens)
                continue
            if fin is None and i >= len(reqs):
                break
            req = reqs[i]
            i += 1
            self.lag.append(max(0.0, await at(req.at)))
            tokens = self.tokens_of.prompt(req)
            hashes = chain(tokens, self.bs, req.lora)
            wid = await self.decide(req, hashes, tokens)
            adm = fleet.submit(wid, req, hashes, tokens, req.at)
            if adm is not None:
                await self.publish(adm, tokens)

    async def _verify(self, session: aiohttp.ClientSession, ours: Ours, dynamo) -> dict:
        """The index against the engines' truth: a replica of our own from the stream, entry by entry; the
        answers of the running systems for a sample of the prompts."""
        out: dict = {}
        from cache_indexer.indexer.service import Indexer
        from cache_indexer.infra.config_loader import load_config

        cfg = load_config(env={}, overrides=[f"nats.url={ours.nats.url}", "snapshot.enabled=false"])
        idx = Indexer(cfg)
        await idx.start()
        try:
            last = (await idx.js.stream_info(cfg.nats.l1Stream.name)).state.last_seq
            await idx.wait_applied(last, 120)
            _debug("verifier applied")
            out.update(compare_state(idx.l1, self.fleet))
            _debug("state compared")
        finally:
            await idx.stop()
        reqs = self.requests
        k = max(1, len(reqs) // max(1, self.p["verify_requests"]))
        sample = reqs[::k]
        bad = {"ours": 0, "dynamo": 0}
        for req in sample:
            tokens = self.tokens_of.prompt(req)
            hashes = chain(tokens, self.bs, req.lora)
            want = self.truth_view(hashes, False)
            tj = ",".join(map(str, tokens))
            for name, url in (("ours", self.ours_url), ("dynamo", getattr(self, "dynamo_url", None))):
                if url is None:
                    continue
                async with session.post(f"{url}/query", data=self.query_body(req, tj),
                                        headers={"Content-Type": "application/json"}) as r:
                    got = self.view_query((json.loads(await r.read())).get("instances") or {}, name == "dynamo")
                bad[name] += got != want
        out.update({"checked": len(sample), "ours_answers_wrong": bad["ours"],
                    "dynamo_answers_wrong": bad["dynamo"] if dynamo else None})
        return out


def compare_state(l1, fleet: Fleet) -> dict:
    """Entry by entry: per worker and medium, the hashes the index holds against those the engine holds."""
    media = {"GPU": l1.index.blocks}
    cpu_index = l1.media.get("CPU") if hasattr(l1, "media") else None
    if cpu_index is not None:
        media["CPU"] = cpu_index.blocks
    missing = extra = entries = 0
    for medium, blocks in media.items():
        held: dict[int, set[int]] = {}
        for h, mask in blocks.items():
            while mask:
                low = mask & -mask
                held.setdefault(low.bit_length() - 1, set()).add(h)
                mask ^= low
        for w in fleet.workers:
            wid = l1.workers.get(w.pod, w.rank)
            got = held.get(wid, set()) if wid is not None else set()
            want = fleet.held(w.wid, medium)
            entries += len(want)
            missing += len(want - got)
            extra += len(got - want)
    return {"state_entries": entries, "state_missing": missing, "state_extra": extra,
            "state_exact": missing == 0 and extra == 0}


async def _at_least(value, target) -> bool:
    return value >= target


async def _at_least_async(coro, target) -> bool:
    return (await coro) >= target


def _spy(where: str | None, run: str, pids: dict[str, int]) -> list[subprocess.Popen]:
    """py-spy on our Python processes (bridge, indexer, engines) over the replay: collapsed stacks (one
    line a stack and its samples, flamegraph.pl's input) in ``where``/<run>-<process>.txt."""
    if not where:
        return []
    spy = os.environ.get("PY_SPY") or shutil.which("py-spy")
    if not spy:
        raise RuntimeError("--profile needs py-spy (pip install py-spy; or PY_SPY=<path>)")
    Path(where).mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--pid", str(pids[name]), "--rate", "250", "--nonblocking", "--format", "raw",
                              "--output", str(Path(where) / f"{run}-{name}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name in ("bridge", "indexer", "engines") if name in pids]


def _unspy(spies: list[subprocess.Popen]) -> None:
    for s in spies:
        s.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for s in spies:
        try:
            s.wait(30)
        except subprocess.TimeoutExpired:
            s.kill()


def _debug(what: str) -> None:
    if os.environ.get("BENCH_TRACE_DEBUG"):
        print(f"trace: {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)


def _dist(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "p50": None, "p99": None, "max": None}
    return {"n": len(xs), "p50": percentile(xs, 50), "p99": percentile(xs, 99), "max": max(xs)}


# -- the whole benchmark ---------------------------------------------------------------------------
def _run_all(p: dict) -> dict:
    requests, block_tokens = load_trace(p["trace"], p["requests"], p["format"])
    assign_loras(requests, p["lora_share"], p["loras"])
    use_dynamo = bool(p["dynamo"])
    runs = []
    for speed in p["speeds"]:
        for policy in p["policies"]:
            print(f"trace: {policy} at {speed:g}x ...", file=sys.stderr, flush=True)
            r = Replay(p, policy, speed, requests, block_tokens, use_dynamo)
            res = asyncio.run(r.run())
            runs.append(res)
            n = res.get("nats_counts", {})
            print(f"trace: {policy} at {speed:g}x: hit {res['hit_rate']:.1%}, agreement {res['agreement']:.2%}, "
                  f"{res['wall_s']:.0f} s; nats-server {n.get('in_msgs', 0):,} messages in, {n.get('out_msgs', 0):,} "
                  f"out over the replay ({r.msg:,} batches)", file=sys.stderr, flush=True)
    span = requests[-1].at if requests else 0.0
    return {"params": {k: v for k, v in p.items()}, "trace_span_s": span, "trace_requests": len(requests),
            "block_tokens": block_tokens, "runs": runs, "machine": machine()}


def _namespaced(p: dict) -> dict:
    """The whole benchmark in a loopback-only network namespace (Dynamo listens on every interface);
    its progress on stderr as it goes."""
    if not shutil.which("unshare") or not shutil.which("ip"):
        raise RuntimeError("Dynamo runs in a loopback-only network namespace: needs unshare and ip")
    code = f"import json, bench.trace as t\nresult = t._run_all(json.loads({json.dumps(json.dumps(p))}))\n" \
           "print('RESULT ' + json.dumps(result))"
    unshare = ["unshare", "-n"] if os.geteuid() == 0 else ["unshare", "-rn"]
    r = subprocess.run([*unshare, "sh", "-c", 'ip link set lo up && exec "$0" -c "$1"', sys.executable, code],
                       cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, NETNS_ENV: "1", "PYTHONPATH": str(ROOT)})
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"the run in a network namespace failed (exit {r.returncode}):\n{r.stdout[-3000:]}")


def params(**overrides) -> dict:
    p = dict(DEFAULTS)
    p.update({k: v for k, v in overrides.items() if v is not None})
    if p["dynamo"] is None:
        p["dynamo"] = dynamo_python() is not None
    if p["dynamo"] and not dynamo_python():
        raise SystemExit("--dynamo: Dynamo's indexer is not installed (pip install -e '.[bench]', or set DYNAMO_PYTHON)")
    if not p["policies"]:
        p["policies"] = [x for x in POLICIES if x != "dynamo" or p["dynamo"]]
    if "dynamo" in p["policies"] and not p["dynamo"]:
        raise SystemExit("policy dynamo needs Dynamo's indexer (DYNAMO_PYTHON)")
    return p


def run(quick: bool = False, **overrides) -> dict:
    given = {k: v for k, v in overrides.items() if v is not None}  # (an option not given is None)
    p = params(**({**QUICK, **given} if quick else given))
    res = _namespaced(p) if p["dynamo"] and os.environ.get(NETNS_ENV) != "1" else _run_all(p)
    if p.get("chart") is not False:
        res["chart"] = chart(res, p.get("chart"))
    return res


# -- report ----------------------------------------------------------------------------------------
def _ms(d: dict, key: str) -> str:
    return "-" if d.get(key) is None else f"{d[key] * 1e3:.1f}"


def table(res: dict) -> str:
    p = res["params"]
    runs = res["runs"]
    extras = ""
    if p["cpu_blocks"]:
        extras += f", a CPU tier of {p['cpu_blocks']:,} blocks"
    if p["lora_share"]:
        extras += f", LoRA on {p['lora_share']:.0%} of requests"
    lines = [f"Trace `{Path(p['trace']).name}`: first {res['trace_requests']:,} requests ({res['trace_span_s']:.0f} s of "
             f"trace, {res['block_tokens']} tokens an id); {p['engines']:,} engines x {p['ranks']} rank(s) x "
             f"{p['blocks_per_engine']:,} GPU blocks of {p['block_size']} tokens{extras}; prefill "
             f"{p['prefill_tps']:,.0f} tokens/s, {p['tpot'] * 1e3:.0f} ms an output token; nats-server's GOMAXPROCS "
             f"{p.get('nats_go_max_procs') or 'Go default'}.", "",
             "| policy | speed | prefix-hit rate | prefill tokens saved | agreement with perfect | answers exact | "
             "freshness p50 / p99 / max (probes) | query p50 / p99 | replay lag p99 / max |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        kv = r["policy"] in KV_POLICIES
        fr, q = r["fresh"], r["query"]
        fresh = f"{_ms(fr, 'p50')} / {_ms(fr, 'p99')} / {_ms(fr, 'max')} ms ({fr['n']:,})" if fr["n"] else "-"
        if r.get("probe_timeouts"):
            fresh += f", {r['probe_timeouts']} never"
        exact = f"{r['exact'] / max(1, r['answered']):.2%}" if kv else "-"
        query = f"{_ms(q, 'p50')} / {_ms(q, 'p99')} ms" if q["n"] else "-"
        lines.append(f"| {r['policy']} | {r['speed']:g}x | {r['hit_rate']:.1%} | {r['saved_tokens'] / 1e6:,.2f}M of "
                     f"{r['prompt_tokens'] / 1e6:,.2f}M | {r['agreement']:.2%} | {exact} | {fresh} | {query} | "
                     f"{_ms(r['lag'], 'p99')} / {_ms(r['lag'], 'max')} ms |")
    dyn = p["dynamo"]
    lines += ["", "CPU seconds of each process over the replay (until every batch is in and 1 s more; in brackets the "
              "system time, kernel work such as loopback TCP, part of it); block events published; the index against the engines' truth after the run (a replica from the stream, entry by "
              "entry; the answers for a sample of the prompts):", "",
              "| policy | speed | batches / stored / removed | bridge | indexer | nats | ours total | " +
              ("Dynamo | ours / Dynamo | " if dyn else "") + "engines | benchmark | index == truth | answers wrong (ours" +
              (" / Dynamo" if dyn else "") + ") |",
              "|---|---|---|---|---|---|---|" + ("---|---|" if dyn else "") + "---|---|---|---|"]
    for r in runs:
        c, v = r["cpu"], r["verify"]
        ks = r.get("cpu_system", {})

        def cs(name: str) -> str:
            return f"{c[name]:.2f} ({ks[name]:.2f})" if name in ks else f"{c[name]:.2f}"
        total = c["bridge"] + c["indexer"] + c["nats"]
        row = (f"| {r['policy']} | {r['speed']:g}x | {r['batches']:,} / {r['stored_events']:,} / {r['removed_events']:,} | "
               f"{cs('bridge')} | {cs('indexer')} | {cs('nats')} | {total:.2f} | ")
        if dyn:
            row += f"{cs('dynamo')} | {total / max(c['dynamo'], 1e-9):.2f}x | "
        exact = "yes" if v["state_exact"] else f"no: {v['state_missing']:,} missing, {v['state_extra']:,} extra"
        wrong = f"{v['ours_answers_wrong']}" + (f" / {v['dynamo_answers_wrong']}" if dyn else "")
        row += f"{c['engines']:.2f} | {c['benchmark']:.2f} | {exact} ({v['state_entries']:,} entries) | {wrong} of {v['checked']} |"
        lines.append(row)
    lines += _marks(runs, dyn)
    if res.get("chart"):
        lines += ["", f"Chart: `{res['chart']}`"]
    return "\n".join(lines)


def _marks(runs: list[dict], dyn: bool) -> list[str]:
    """Per speed, the issue's marks: agreement of our KV policies with perfect knowledge; ingest CPU of our
    processes against Dynamo's where neither is asked to route (its work alone); query latency through
    ``/query`` against Dynamo's."""
    out = ["", "Per speed:", ""]
    for speed in dict.fromkeys(r["speed"] for r in runs):
        at = {r["policy"]: r for r in runs if r["speed"] == speed}
        parts = [f"{pol} {at[pol]['agreement']:.2%}" for pol in ("kv-seed", "kv-query", "dynamo") if pol in at]
        line = f"- {speed:g}x: agreement with perfect knowledge: {', '.join(parts) or '-'}"
        quiet = [r for pol, r in at.items() if pol not in KV_POLICIES]
        if dyn and quiet:
            ours = sum(r["cpu"]["bridge"] + r["cpu"]["indexer"] + r["cpu"]["nats"] for r in quiet)
            theirs = sum(r["cpu"]["dynamo"] for r in quiet)
            line += (f"; ingest CPU (runs without routing queries: {', '.join(r['policy'] for r in quiet)}) ours "
                     f"{ours:.2f} s / Dynamo {theirs:.2f} s = {ours / max(theirs, 1e-9):.2f}x")
            woken = [r for r in quiet if r.get("wakeups") and r["batches"]]
            if woken:
                per = {k: sum(r["wakeups"].get(k, 0) for r in woken) / sum(r["batches"] for r in woken)
                       for k in ("bridge", "indexer", "nats", "dynamo")}
                line += (f"; wake-ups a batch (voluntary context switches of all threads): bridge {per['bridge']:.1f}, "
                         f"indexer {per['indexer']:.1f}, nats-server {per['nats']:.1f}, Dynamo {per['dynamo']:.1f}")
        if "kv-query" in at and "dynamo" in at and at["kv-query"]["query"]["n"] and at["dynamo"]["query"]["n"]:
            q, d = at["kv-query"]["query"], at["dynamo"]["query"]
            line += (f"; /query p50 / p99 ours {q['p50'] * 1e3:.2f} / {q['p99'] * 1e3:.2f} ms, Dynamo "
                     f"{d['p50'] * 1e3:.2f} / {d['p99'] * 1e3:.2f} ms ({q['p50'] / d['p50']:.2f} / {q['p99'] / d['p99']:.2f}x)")
        out.append(line)
    return out


def chart(res: dict, path: str | None) -> str | None:
    """Hit rate and freshness against speed, a line per policy (matplotlib; None without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("trace: no chart (matplotlib is not installed: pip install matplotlib)", file=sys.stderr)
        return None
    path = path or str(Path(tempfile.gettempdir()) / "cache-indexer-trace.png")
    runs = res["runs"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pol in policies:
        rs = sorted((r for r in runs if r["policy"] == pol), key=lambda r: r["speed"])
        a.plot([r["speed"] for r in rs], [r["hit_rate"] * 100 for r in rs], marker="o", label=pol)
        if pol in KV_POLICIES:
            rs = [r for r in rs if r["fresh"]["n"]]
            if rs:
                line, = b.plot([r["speed"] for r in rs], [r["fresh"]["p50"] * 1e3 for r in rs], marker="o",
                               label=f"{pol} p50")
                b.plot([r["speed"] for r in rs], [r["fresh"]["p99"] * 1e3 for r in rs], marker="^", linestyle="--",
                       color=line.get_color(), label=f"{pol} p99")
    p = res["params"]
    a.set_ylim(bottom=0)
    a.set(xlabel="replay speed (x)", ylabel="fleet prefix-hit rate (%)", xscale="log",
          title=f"{p['engines']} engines, {res['trace_requests']:,} requests")
    b.set(xlabel="replay speed (x)", ylabel="freshness: publish to answer (ms)", xscale="log", yscale="log",
          title="freshness of the routed index")
    from matplotlib.ticker import FuncFormatter, NullFormatter, ScalarFormatter

    speeds = sorted({r["speed"] for r in runs})
    for ax in (a, b):
        ax.set_xticks(speeds)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    b.yaxis.set_major_formatter(plain)
    b.yaxis.set_minor_formatter(plain)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help=f"a Mooncake or Bailian JSONL trace (.gz too); default: the committed sample "
                                    f"({SAMPLE.relative_to(ROOT)})")
    ap.add_argument("--format", choices=["auto", "mooncake", "bailian"])
    ap.add_argument("--requests", type=int, help=f"the first N requests (default {DEFAULTS['requests']})")
    ap.add_argument("--speed", type=float, action="append", dest="speeds",
                    help="replay speed, x real time; repeat for the chart (default 20 and 60)")
    ap.add_argument("--engines", type=int, help="pods (default 8)")
    ap.add_argument("--ranks", type=int, help="data-parallel ranks a pod (default 1)")
    ap.add_argument("--blocks-per-engine", type=int, help="GPU blocks a rank (default 50,000)")
    ap.add_argument("--block-size", type=int, help="tokens a block (default 16)")
    ap.add_argument("--cpu-blocks", type=int, help="CPU offload tier, blocks a rank (default 0: none)")
    ap.add_argument("--lora-share", type=float, help="share of requests on a LoRA adapter (default 0)")
    ap.add_argument("--loras", type=int, help="adapters (default 4)")
    ap.add_argument("--prefill-tps", type=float, help="prefill tokens a second an engine (default 10,000)")
    ap.add_argument("--tpot", type=float, help="seconds an output token (default 0.03)")
    ap.add_argument("--policies", help="comma-separated, of: " + ", ".join(POLICIES) + " (default: all; dynamo "
                                       "where Dynamo is installed)")
    ap.add_argument("--dynamo", action=argparse.BooleanOptionalAction,
                    help="Dynamo's indexer beside ours in every run (default: where DYNAMO_PYTHON or the module is found)")
    ap.add_argument("--verify-requests", type=int, help="prompts whose answers are checked after each run (default 200)")
    ap.add_argument("--no-probe", dest="probe", action="store_false", default=None, help="no freshness probes")
    ap.add_argument("--chart", help="where the PNG goes (default: the temp dir's cache-indexer-trace.png)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--profile", metavar="DIR", help="py-spy the bridge, the indexer and the engines over each replay: "
                                                     "collapsed stacks in DIR (needs py-spy)")
    ap.add_argument("--nats-go-max-procs", type=int, dest="nats_go_max_procs",
                    help="nats-server's GOMAXPROCS (default: the chart's nats.goMaxProcs, "
                         f"{DEFAULTS['nats_go_max_procs']}; 0: Go's own choice)")
    ap.add_argument("--quick", action="store_true", help="200 requests at 60x")
    return ap


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    over = {k: v for k, v in vars(a).items() if k not in ("quick", "json")}
    if over.get("policies"):
        over["policies"] = [x.strip() for x in over["policies"].split(",") if x.strip()]
        unknown = set(over["policies"]) - set(POLICIES)
        if unknown:
            raise SystemExit(f"unknown policies: {', '.join(sorted(unknown))}")
    res = run(quick=a.quick, **over)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(f"- machine: {res['machine']}\n- command: `python -m bench.trace {' '.join(argv)}`\n")
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
