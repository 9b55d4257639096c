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


def ms(x: float) -> str:
    return f"{x * 1000:.2f} ms"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a subprocess that must be told its port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
