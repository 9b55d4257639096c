"""``cache-indexer events decode``: one stream message payload, read on stdin, printed as JSON text.

This is the command the nats CLI's ``--translate`` runs: for each message it pipes the payload to the
command's stdin and shows what the command prints (stdout and stderr) instead of the bytes; on a non-zero
exit it shows that output quoted with "Error while translating msg body". It passes nothing else: no
environment variable, no headers; the command line may hold ``{{ Subject }}`` and ``{{ Stream }}``
(Go templates), which this decoder does not need, a payload says what it is. Run once per message, so
it imports only the codec (cli.main routes here before building the full parser).
"""

from __future__ import annotations

import argparse
import json
import sys

from cache_indexer.infra.event_codec import MalformedEvent, decode, encoding_of

#: NATS refuses payloads over 64 MiB whatever its configuration: ``decode`` reads no more.
MAX_PAYLOAD = 64 << 20
MESSAGE_TYPES = frozenset({"batch", "reset", "pod_removed", "rank_removed", "l3_diff", "l3_full"})


def readable(payload):
    """A decoded payload as printed: L1 block hashes also in 16-digit hex (as vLLM's logs and the
    ``/query`` API write them)."""
    for ev in payload.get("events", []) if isinstance(payload, dict) else []:
        if isinstance(ev, dict) and isinstance(ev.get("hashes"), list):
            ev["hashes_hex"] = [f"{h:016x}" if isinstance(h, int) and h >= 0 else h for h in ev["hashes"]]
    return payload


def decode_one(data: bytes, pretty: bool = False) -> str:
    """One payload as JSON text. Raises MalformedEvent for anything but a message of schemas/events.py's
    types (in either encoding)."""
    if not data:
        raise MalformedEvent("empty payload")
    payload = decode(data)
    if not isinstance(payload, dict) or payload.get("type") not in MESSAGE_TYPES:
        kind = payload.get("type") if isinstance(payload, dict) else type(payload).__name__
        raise MalformedEvent(f"a {encoding_of(data)} value, but not a cache-indexer event (type {kind!r})")
    return json.dumps(readable(payload), indent=2 if pretty else None, ensure_ascii=False, default=str)


def decode_stdin(stdin=None, out=None, err=None, pretty: bool = False) -> int:
    """Read one payload (at most MAX_PAYLOAD bytes) from stdin, print it as JSON; 1 on anything else."""
    stdin = stdin if stdin is not None else sys.stdin.buffer
    out, err = out or sys.stdout, err or sys.stderr
    data = stdin.read(MAX_PAYLOAD + 1)
    if len(data) > MAX_PAYLOAD:
        print(f"cache-indexer events decode: input over {MAX_PAYLOAD >> 20} MiB: not one NATS message", file=err)
        return 1
    try:
        text = decode_one(data, pretty)
    except MalformedEvent as exc:
        print(f"cache-indexer events decode: {exc} ({len(data)} bytes, starting {data[:16].hex() or '-'})", file=err)
        return 1
    print(text, file=out)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="cache-indexer events decode",
                                description="Prints one stream message payload (msgpack or JSON), read on stdin, "
                                            "as JSON; exit 1 on anything else. For the nats CLI: nats stream view "
                                            "KV_L1 --translate 'cache-indexer events decode'. See docs/events.md.")
    p.add_argument("--pretty", action="store_true", help="indented JSON")
    args = p.parse_args(argv)
    return decode_stdin(pretty=args.pretty)
