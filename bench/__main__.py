"""python -m bench [all|hashing|memory|query|ingest|replay|refcounts|l3|dynamo|fanout|events|fleet|trace] [--quick] [--full] [--write]

Runs the benchmarks and prints one Markdown report; --write also stores it in bench/RESULTS.md.
"""

from __future__ import annotations

import datetime
import inspect
import sys
from pathlib import Path

from bench import common

SECTIONS = {
    "hashing": ("Block hashing (full chain) vs hashlib sha256 over the same serialized bytes", "bench.hashing"),
    "memory": ("L1 index memory per (block, worker) entry at 1M entries", "bench.memory"),
    "query": ("Hit-rate query latency over HTTP (1M-entry index) and throughput under load", "bench.query"),
    "ingest": ("End-to-end ingest: ZMQ -> bridge -> JetStream -> indexer", "bench.ingest"),
    "replay": ("Rebuild from the stream: replay and snapshot + tail", "bench.replay"),
    "refcounts": ("L1 apply rate and memory with duplicate block copies counted", "bench.refcounts"),
    "l3": ("Mooncake polling in local mode: poll time, CPU per poll and API latency while polls run", "bench.l3_poll"),
    "dynamo": ("Side by side with NVIDIA Dynamo's standalone KV indexer: ingest, CPU, query", "bench.dynamo"),
    "fanout": ("The index partitioned by worker: a query fanned out to two partitions", "bench.fanout"),
    "events": ("Stream payload encodings: msgpack and JSON (readable with the nats CLI)", "bench.event_encoding"),
    "fleet": ("A fleet: fill, snapshots, a rolling update of every pod, discovery churn and a restore, with the query "
              "path probed",
              "bench.fleet"),
    "trace": ("A trace-driven fleet: a public trace replayed through simulated vLLM engines, routed by each policy "
              "(python -m bench.trace for its options)", "bench.trace"),
}


def _parser():
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n", 1)[1].strip(),
                                epilog="benchmarks: " + ", ".join(f"{k} ({v[0]})" for k, v in SECTIONS.items()))
    p.add_argument("names", nargs="*", metavar="NAME", choices=["all", *SECTIONS], default=["all"],
                   help="benchmarks to run (default: all)")
    p.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    p.add_argument("--full", action="store_true", help="full sizes where a benchmark has them (fleet: 50M entries)")
    p.add_argument("--write", action="store_true", help="also write the report to bench/RESULTS.md")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    quick = args.quick
    names = list(SECTIONS) if "all" in args.names else list(dict.fromkeys(args.names))
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
        res = mod.run(quick=quick, full=True) if args.full and "full" in inspect.signature(mod.run).parameters \
            else mod.run(quick=quick)
        parts += [f"## {title}", "", (mod.__doc__ or "").strip(), "", mod.table(res), ""]
    report = "\n".join(parts)
    print(report)
    if args.write:
        (Path(__file__).parent / "RESULTS.md").write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
