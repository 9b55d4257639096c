"""``python -m bench [all|hashing|memory|query|ingest|replay] [--quick] [--write]``

Runs the benchmarks and prints one Markdown report; ``--write`` also stores it in bench/RESULTS.md.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from bench import common

SECTIONS = {
    "hashing": ("Block hashing (full chain) vs hashlib sha256 over the same serialized bytes", "bench.hashing"),
    "memory": ("L1 index memory per (block, worker) entry at 1M entries", "bench.memory"),
    "query": ("Hit-rate query latency over HTTP (1M-entry index) and throughput under load", "bench.query"),
    "ingest": ("End-to-end ingest: ZMQ -> bridge -> JetStream -> indexer", "bench.ingest"),
    "replay": ("Rebuild from the stream: replay and snapshot + tail", "bench.replay"),
    "l3": ("Mooncake poll time vs key count", "bench.l3_poll"),
}


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    names = [a for a in argv if not a.startswith("--")] or ["all"]
    if names == ["all"]:
        names = list(SECTIONS)
    import importlib

    parts = ["# cache-indexer benchmark results", "",
             f"- date: {datetime.date.today().isoformat()}", f"- machine: {common.machine()}",
             f"- command: `python -m bench {' '.join(argv)}`".rstrip(), ""]
    for name in names:
        title, module = SECTIONS[name]
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            parts += [f"## {title}", "", f"not available: {exc}", ""]
            continue
        print(f"running {name} ...", file=sys.stderr, flush=True)
        res = mod.run(quick=quick)
        parts += [f"## {title}", "", (mod.__doc__ or "").strip(), "", mod.table(res), ""]
    report = "\n".join(parts)
    print(report)
    if "--write" in argv:
        (Path(__file__).parent / "RESULTS.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
