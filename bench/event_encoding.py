"""What the JSON payload encoding (``nats.l1Stream.encoding: json``, docs/events.md) costs against
msgpack: per message, the bridge's encode and the indexer's decode (this process, the same messages the
bridge writes from vLLM batches of the ingest benchmark) and the bytes; end to end, the ingest benchmark
(bench/ingest.py) run with each encoding in turn, with the stream's bytes per block event.
"""

from __future__ import annotations

import asyncio
import sys

from bench.common import summary, timeit
from bench.engine_proc import payloads
from bench.ingest import _run
from cache_indexer.bridge.l1_publisher import run_message
from cache_indexer.bridge.vllm_events import decode_batch
from cache_indexer.infra.event_codec import JSON, MSGPACK, decode

GEN = 1_764_900_000_000_000_000


def _messages(events: int, coalesced: int) -> list[dict]:
    """L1 messages as the bridge writes them: runs of ``coalesced`` vLLM batches of ``events`` events."""
    batches = [decode_batch(p) for p in payloads(64 * coalesced, events, 1)]
    out = []
    for i in range(0, len(batches), coalesced):
        run = [(i + j, b.ts, b.events) for j, b in enumerate(batches[i:i + coalesced])]
        out.append(run_message("10.0.0.1", 0, GEN, run) if coalesced > 1 else
                   {"v": 1, "type": "batch", "pod": "10.0.0.1", "rank": 0, "gen": GEN, "seq": i, "ts": run[0][1],
                    "events": run[0][2]})
    return out


def micro(quick: bool = False) -> list[dict]:
    rows = []
    for events, coalesced in ((32, 1), (8, 1), (8, 64)):
        msgs = _messages(events, coalesced)
        hashes = sum(len(e.get("hashes", ())) or 1 for m in msgs for e in m["events"])
        for codec in (MSGPACK, JSON):
            data = [codec.encode(m) for m in msgs]
            enc = summary(timeit(lambda: [codec.encode(m) for m in msgs], repeat=5 if quick else 20))
            dec = summary(timeit(lambda: [decode(d) for d in data], repeat=5 if quick else 20))
            rows.append({"shape": f"{events} events/batch" + (f", runs of {coalesced}" if coalesced > 1 else ""),
                         "encoding": codec.name, "bytes_per_event": sum(map(len, data)) / hashes,
                         "encode_ns": enc["median"] * 1e9 / hashes, "decode_ns": dec["median"] * 1e9 / hashes})
    return rows


def end_to_end(quick: bool = False, rounds: int = 5) -> list[dict]:
    shape = (4000, 32, 2) if quick else (20000, 32, 4)
    rows = []
    for _ in range(1 if quick else rounds):  # alternated, so that a slower spell of a shared machine hits both
        for encoding in ("msgpack", "json"):
            rows.append(asyncio.run(_run(*shape, encoding=encoding)))
    return rows


def run(quick: bool = False) -> tuple[list[dict], list[dict]]:
    return micro(quick), end_to_end(quick)


def table(result: tuple[list[dict], list[dict]]) -> str:
    micro_rows, e2e = result
    lines = ["Per block event, the messages the bridge writes (median of the runs):", "",
             "| messages | encoding | bytes / block event | bridge encode ns / block event | "
             "indexer decode ns / block event |", "|---|---|---|---|---|"]
    for r in micro_rows:
        lines.append(f"| {r['shape']} | {r['encoding']} | {r['bytes_per_event']:.1f} | {r['encode_ns']:.0f} | "
                     f"{r['decode_ns']:.0f} |")
    lines += ["", "End to end (bench/ingest.py), the encodings alternated; CPU per block event of the bridge process, "
              "the indexer (the benchmark's process) and nats-server, which a busy shared machine does not inflate as "
              "it does wall time:", "",
              "| encoding | engines | batches | block events | seconds | end-to-end block-events/s | stream bytes / "
              "block event | bridge CPU ns / block event | indexer CPU ns / block event | nats-server CPU ns / block "
              "event |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in e2e:
        n = max(1, r["block_events"])
        lines.append(f"| {r['encoding']} | {r['engines']} | {r['batches']:,} | {r['block_events']:,} | "
                     f"{r['seconds']:.2f} | **{r['rate']:,.0f}** | {r['stream_bytes'] / n:.1f} | "
                     f"{r['bridge_cpu'] * 1e9 / n:.0f} | {r['indexer_cpu'] * 1e9 / n:.0f} | "
                     f"{r['server_cpu'] * 1e9 / n:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run(quick="--quick" in sys.argv)))
