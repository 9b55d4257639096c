"""Timing helpers shared by the benchmarks: repeated runs, medians and p99."""

from __future__ import annotations

import platform
import socket
import statistics
import time
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def timeit(fn: Callable[[], object], repeat: int = 30, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def summary(samples: list[float]) -> dict:
    return {"median": statistics.median(samples), "p99": percentile(samples, 99)}


def threads_cpu(pid: int) -> tuple[float, int]:
    """(CPU seconds, voluntary context switches) of a process's threads alive now, the CPU to the
    nanosecond (``/proc/<pid>/task/<tid>/schedstat``; ``/proc/<pid>/stat`` counts in 10 ms ticks, too coarse
    for a quiet process's second or one query). A thread that ended meanwhile is not counted: compare
    over a span in which a process keeps its threads."""
    import os

    cpu = switches = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                cpu += int(f.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches += int(f.read().split("voluntary_ctxt_switches:", 1)[1].split(None, 1)[0])
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return cpu / 1e9, switches


def machine() -> str:
    import os

    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, {platform.system()} {platform.machine()}"


async def post_latencies(session, path: str, bodies: list[bytes], n: int, warmup: int,
                         pace: float = 0.0, burst: int = 1) -> list[float]:
    """Seconds each of ``n`` JSON POSTs to ``path`` took, one after the other (``bodies`` in turn), after
    ``warmup`` untimed ones, ``pace`` seconds apart (0: back to back); every answer must be a 200.
    ``burst``: that many sent at once (each on a connection of its own), the next burst after the last
    answer of this one."""
    import asyncio

    async def one(body: bytes) -> float:
        t = time.perf_counter()
        async with session.post(path, data=body, headers={"Content-Type": "application/json"}) as r:
            payload = await r.read()
            assert r.status == 200, payload[:200]
        return time.perf_counter() - t

    out = []
    for i in range(0, n + warmup, burst):
        if pace and i:
            await asyncio.sleep(pace)
        took = await asyncio.gather(*(one(bodies[(i + k) % len(bodies)]) for k in range(min(burst, n + warmup - i))))
        out += took[max(0, warmup - i):]  # exactly ``warmup`` untimed, ``n`` timed, whatever the burst
    return out


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


#: below Linux's ephemeral range (32768-60999): no outgoing connection takes one; above the trace
#: benchmark's simulated engines (bench/trace_engines.py PORT_RANGE), whose ports Dynamo's listener on
#: every interface would otherwise meet
_PORTS_LOW, _PORTS_HIGH = 20000, 32768
_handed_out: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a subprocess that must be told its port: never one handed out
    before by this process (the kernel's ``bind(0)`` may give the same port twice in a row), outside the
    ephemeral range (a client's connection may take one of those before the subprocess binds it), and drawn
    at random (another test process on the machine draws from the same range)."""
    import random

    draw = random.SystemRandom()
    for _ in range(1000):
        port = draw.randrange(_PORTS_LOW, _PORTS_HIGH)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free TCP port found in {_PORTS_LOW}-{_PORTS_HIGH - 1} on 127.0.0.1")
