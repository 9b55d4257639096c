"""Memory per indexed (block, worker) entry of the L1 index at a million entries.

Both indexes: the pure-Python one, measured with tracemalloc (every Python allocation it makes: dict
table, int keys, masks), and the native one (``NativeBlockIndex``): what its tables allocated plus
what tracemalloc sees of its Python side. Two shapes: every block on one worker only (the worst case:
one entry per pair), and a fleet where common prefixes are cached on several pods (one entry serves
several pairs).
"""

from __future__ import annotations

import gc
import random
import tracemalloc

from cache_indexer.indexer.block_index import BlockIndex, NativeBlockIndex, _native_index


def _measure(build) -> tuple[int, int, int]:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = build()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    if isinstance(idx, NativeBlockIndex):
        used += idx.memory_bytes()
    return used, idx.entries(), len(idx)


def _unique(n_entries: int, workers: int = 16, kind: type = BlockIndex) -> BlockIndex:
    rng = random.Random(1)
    idx = kind()
    per = n_entries // workers
    for w in range(workers):
        idx.store(w, [rng.getrandbits(64) for _ in range(per)])
    return idx


def _shared(n_entries: int, workers: int = 16, kind: type = BlockIndex) -> BlockIndex:
    """Each worker holds 62,500 blocks: 40% from a pool of shared prefixes, the rest its own."""
    rng = random.Random(2)
    idx = kind()
    per = n_entries // workers
    pool = [rng.getrandbits(64) for _ in range(per)]
    for w in range(workers):
        shared = rng.sample(pool, int(per * 0.4))
        own = [rng.getrandbits(64) for _ in range(per - len(shared))]
        idx.store(w, shared + own)
    return idx


def run(quick: bool = False, n_entries: int = 1_000_000) -> list[dict]:
    rows = []
    kinds = [("pure Python", BlockIndex)] + ([("native", NativeBlockIndex)] if _native_index is not None else [])
    for index, kind in kinds:
        for name, build in (("no sharing (worst case)", _unique), ("40% shared prefixes", _shared)):
            used, entries, keys = _measure(lambda b=build, k=kind: b(n_entries, kind=k))
            rows.append({"index": index, "shape": name, "entries": entries, "distinct_blocks": keys, "bytes": used,
                         "bytes_per_entry": used / entries})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| index | shape | (block, worker) entries | distinct blocks | bytes | bytes / entry |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['index']} | {r['shape']} | {r['entries']:,} | {r['distinct_blocks']:,} | "
                     f"{r['bytes'] / 2**20:.1f} MiB | {r['bytes_per_entry']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()))
