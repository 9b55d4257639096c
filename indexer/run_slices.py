"""A coalesced run of vLLM batches cut, at batch boundaries, into runs of a bounded number of blocks.

The bridge gathers up to ``coalesceMaxBatches`` batches of one worker into one stream message (16k
block events and more while a backlog is worked off). Applied in one step, such a message held the
event loop, and every query behind it, for 7-9 ms at 50M entries. The indexer applies the slices one
after the other and lets the loop answer queries between them. Each slice is a run of whole batches,
so a query in between sees the worker as it was after some batch: a state the engine itself went
through. A snapshot taken between slices records the message as not applied; when it is applied again
after a restore, the overlap rule of runs (indexer/l1_state.py) applies only what the snapshot lacks.
"""

from __future__ import annotations

from cache_indexer.schemas.events import run_error

#: block events in a slice (a single batch larger than this is one slice of its own)
SLICE_BLOCKS = 4096


def run_slices(msg: dict, max_blocks: int = SLICE_BLOCKS) -> list[dict]:
    """``msg`` itself (in a list) unless it is a well-formed run of more than ``max_blocks`` block events;
    a malformed one is left whole, for the state to refuse it as it would."""
    if msg.get("type") != "batch" or "last_seq" not in msg or run_error(msg):
        return [msg]
    events, ends, seq = msg["events"], msg["ends"], msg["seq"]
    sizes = [len(e.get("hashes") or ()) or 1 if isinstance(e, dict) else 1 for e in events]
    if sum(sizes) <= max_blocks:
        return [msg]
    out: list[dict] = []
    first = 0  # the first batch of the slice being gathered
    blocks = 0
    for i, end in enumerate(ends):
        start = ends[i - 1] if i else 0
        size = sum(sizes[start:end])
        if blocks and blocks + size > max_blocks:
            out.append(_slice(msg, seq, first, i))
            first, blocks = i, 0
        blocks += size
    out.append(_slice(msg, seq, first, len(ends)))
    return out


def _slice(msg: dict, seq: int, first: int, stop: int) -> dict:
    """Batches first .. stop - 1 of the run, as a run of their own."""
    ends = msg["ends"]
    base = ends[first - 1] if first else 0
    return {**msg, "seq": seq + first, "last_seq": seq + stop - 1, "ends": [e - base for e in ends[first:stop]],
            "events": msg["events"][base:ends[stop - 1]]}
