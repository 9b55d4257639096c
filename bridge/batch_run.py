"""Consecutive vLLM batches of one worker gathered into one stream message.

A stream message costs the same whatever it holds (headers built and parsed, an ack, a delivery to every
replica, nats-py's per-message work on both sides), and a vLLM batch often holds one block event: per
event, the message was the cost. The subscriber adds each batch it hands on to its run and sends the run
when it is full (``maxBatches`` batches, or ``maxBytes`` of encoded events, estimated) and whenever it is
about to wait: after each burst of its queue, before a replay or a reset. So batches are gathered only
while a backlog is being worked off; a lone batch goes out at once, no time is spent waiting for company.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cache_indexer.bridge.l1_publisher import HASH_BYTES

#: an allowance for an event's fields besides its hashes
EVENT_BYTES = 48


def events_size(events: list[dict]) -> tuple[int, int]:
    """(block events as the indexers count them, estimated encoded bytes) of a batch's events."""
    n = size = 0
    for e in events:
        k = len(e.get("hashes", ()))
        n += k or 1
        size += k * HASH_BYTES + EVENT_BYTES
    return n, size


@dataclass(slots=True)
class BatchRun:
    max_batches: int
    max_bytes: int
    gen: int = 0
    #: (seq, vLLM timestamp, events) of each batch, consecutive seqs
    batches: list[tuple[int, float | None, list[dict]]] = field(default_factory=list)
    size: int = 0
    #: for the bridge's metrics, counted when the run is published
    block_events: int = 0

    def takes(self, gen: int, seq: int, size: int) -> bool:
        """Whether a batch can join: same generation, the next seq, and room left (an empty run takes any)."""
        if not self.batches:
            return True
        return (gen == self.gen and seq == self.batches[-1][0] + 1 and len(self.batches) < self.max_batches
                and self.size + size <= self.max_bytes)

    def add(self, gen: int, seq: int, ts: float | None, events: list[dict], size: int, block_events: int) -> None:
        if not self.batches:
            self.gen = gen
        self.batches.append((seq, ts, events))
        self.size += size
        self.block_events += block_events

    def full(self) -> bool:
        return len(self.batches) >= self.max_batches or self.size >= self.max_bytes

    def take(self) -> list[tuple[int, float | None, list[dict]]]:
        out, self.batches, self.size, self.block_events = self.batches, [], 0, 0
        return out
