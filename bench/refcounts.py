"""L1 apply rate and memory with vLLM's duplicate block copies counted (BlockIndex.copies).

Same-run baseline: the index as it was before copies were counted (``indexer/l1_index.py`` at commit
548a78e, now ``indexer/block_index.py``, read from git history; skipped with a note where the clone has no history). Both apply the
same 1M store/remove block events to 16 workers: eviction-heavy traffic without duplicates (the common
case), and with 10% of the stores being a second copy of a cached block. Memory: tracemalloc of the
index after 1M stores without duplicates. Medians of 5 runs.
"""

from __future__ import annotations

import gc
import importlib.util
import random
import statistics
import subprocess
import tempfile
import time
import tracemalloc
from pathlib import Path

from cache_indexer.indexer.block_index import BlockIndex

BASELINE_COMMIT = "548a78e"
ROOT = Path(__file__).resolve().parents[1]


def _baseline_class():
    try:
        src = subprocess.run(["git", "show", f"{BASELINE_COMMIT}:indexer/l1_index.py"], cwd=ROOT, check=True,
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    path = Path(tempfile.mkdtemp()) / "l1_index_before_copies.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("l1_index_before_copies", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.BlockIndex


def _ops(events: int, dup_share: float, workers: int = 16, seed: int = 1) -> list[tuple[int, bool, list[int]]]:
    """(worker, store?, hashes) batches of 32; each worker keeps ~20k blocks, evicting the oldest."""
    rng = random.Random(seed)
    live: list[list[int]] = [[] for _ in range(workers)]
    out = []
    done = 0
    while done < events:
        w = rng.randrange(workers)
        if len(live[w]) > 20000:
            gone, live[w] = live[w][:32], live[w][32:]
            out.append((w, False, gone))
        else:
            hs = [rng.choice(live[w]) if live[w] and rng.random() < dup_share else rng.getrandbits(64)
                  for _ in range(32)]
            live[w].extend(hs)
            out.append((w, True, hs))
        done += 32
    return out


def _apply_rate(cls, ops) -> float:
    runs = []
    for _ in range(5):
        idx = cls()
        gc.collect()
        t = time.perf_counter()
        for w, store, hs in ops:
            (idx.store if store else idx.remove)(w, hs)
        runs.append(time.perf_counter() - t)
    return sum(len(hs) for _, _, hs in ops) / statistics.median(runs)


def _bytes_per_entry(cls, n: int = 1_000_000) -> float:
    rng = random.Random(2)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = cls()
    for w in range(16):
        idx.store(w, [rng.getrandbits(64) for _ in range(n // 16)])
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / idx.entries()


def run(quick: bool = False) -> dict:
    events = 200_000 if quick else 1_000_000
    baseline = _baseline_class()
    res = {"events": events, "baseline": baseline is not None, "rows": []}
    for name, share in (("no duplicates", 0.0), ("10% duplicate copies", 0.1)):
        ops = _ops(events, share)
        now = _apply_rate(BlockIndex, ops)
        before = _apply_rate(baseline, ops) if baseline else None
        res["rows"].append((name, now, before))
    res["memory"] = (_bytes_per_entry(BlockIndex), _bytes_per_entry(baseline) if baseline else None)
    return res


def table(res: dict) -> str:
    lines = ["| traffic | block events | with copies counted | before (same run) | ratio |", "|---|---|---|---|---|"]
    for name, now, before in res["rows"]:
        b = f"{before:,.0f} /s" if before else "n/a (no git history)"
        r = f"{now / before:.2f}x" if before else "-"
        lines.append(f"| {name} | {res['events']:,} | **{now:,.0f} /s** | {b} | {r} |")
    mem_now, mem_before = res["memory"]
    lines.append("")
    lines.append(f"Memory per (block, worker) entry at 1M entries, no duplicates: **{mem_now:.1f} B** with copies "
                 f"counted" + (f", {mem_before:.1f} B before" if mem_before else "") + ".")
    return "\n".join(lines)
