"""Wire contract of the JetStream streams: normalized, versioned L1 events published by the bridge.

One message per vLLM ``KVEventBatch`` (type ``batch``), or per run of consecutive batches of one worker
that the bridge coalesced (``last_seq``, ``ends``), plus control messages (``reset``,
``pod_removed``) on the same stream so every indexer replica sees them in the same order. Payloads
are maps of exactly these models, msgpack (the default) or JSON (``nats.l1Stream.encoding`` /
``l3Stream.encoding``: readable with the nats CLI alone); infra/event_codec.py reads both, so a stream may
hold both. Block hashes are the uint64 form of vLLM's int events.
The hot paths encode and decode plain dicts; tests validate what the bridge writes against these models.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1
CONTENT_TYPE_L1 = "application/vnd.cache-indexer.l1-event+msgpack"
CONTENT_TYPE_L3 = "application/vnd.cache-indexer.l3-event+msgpack"
#: (the JSON encoding's end in ``+json`` instead: infra/event_codec.py)

U64 = Annotated[int, Field(ge=0, lt=1 << 64)]
#: The index keeps the KV-cache groups a worker holds a block in as a 64-bit mask.
MAX_GROUP_IDX = 63
#: Tokens per block: vLLM's are 16-128 (hybrid models align theirs to a few thousand at most).
MAX_BLOCK_SIZE = 1 << 16
GroupIdx = Annotated[int, Field(ge=0, le=MAX_GROUP_IDX)]
#: vLLM numbers batches with an int64 counter from 0: a seq past it is garbage (or forged).
MAX_SEQ = (1 << 63) - 1
#: A generation is the bridge's wall clock (ns) when it started one; further than this ahead of the time
#: the stream stored the message, it is forged or broken (a generation of 2^63 blinded a pod for ever:
#: every later, real one is older).
GEN_MAX_AHEAD_NS = 600 * 10**9
Medium = Literal["GPU", "CPU", "STORAGE"] | str | None


def last_seq(msg: dict) -> int:
    """The last vLLM seq a batch message covers (its seq, or a run's last_seq)."""
    last = msg.get("last_seq")
    return msg["seq"] if last is None else last


def run_error(msg: dict) -> str | None:
    """Why a batch message's run fields (``last_seq``, ``ends``) do not hold together; None when they do
    or it is a single batch. Shared by the model below and the indexer, which gets plain dicts."""
    last, ends = msg.get("last_seq"), msg.get("ends")
    if last is None and ends is None:
        return None
    seq, events = msg.get("seq"), msg.get("events")
    if not (type(last) is int and type(seq) is int and isinstance(ends, list) and isinstance(events, list)):
        return "a run needs int seq and last_seq, and lists ends and events"
    if not seq <= last <= MAX_SEQ or len(ends) != last - seq + 1:
        return f"run {seq}..{last} with {len(ends)} ends"
    if msg.get("parts", 1) != 1:
        return "a run is never in parts"
    prev = 0
    for end in ends:
        if type(end) is not int or end < prev:
            return "ends must be non-decreasing ints"
        prev = end
    if prev != len(events):
        return f"the last end is {prev}, with {len(events)} events"
    return None


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BlocksStored(_Event):
    kind: Literal["stored"]
    medium: Medium = Field(None, description="vLLM medium; absent (None) means GPU. Only GPU feeds L1.")
    hashes: list[U64]
    parent: U64 | None = None
    block_size: Annotated[int, Field(ge=1, le=MAX_BLOCK_SIZE)] | None = None
    lora_name: str | None = None
    group_idx: GroupIdx | None = None


class BlocksRemoved(_Event):
    kind: Literal["removed"]
    medium: Medium = None
    hashes: list[U64]
    group_idx: GroupIdx | None = None


class AllBlocksCleared(_Event):
    kind: Literal["cleared"]
    medium: Medium = None


BlockEvent = Annotated[Union[BlocksStored, BlocksRemoved, AllBlocksCleared], Field(discriminator="kind")]


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    v: Literal[1] = SCHEMA_VERSION
    pod: str = Field(description="Pod IP, the key the hit-rate API is asked by.")


class L1Batch(_Message):
    """One vLLM KVEventBatch from one (pod, data-parallel rank), or a run of consecutive ones.

    A run (``last_seq`` set) holds batches ``seq`` .. ``last_seq``; their events one after the other in
    ``events``, batch i's ending before ``ends[i]``; ``ts`` is the last batch's. Coalescing saves a
    stream message, its headers and its ack per batch; the boundaries let an indexer that already
    applied the first few batches (an overlap) apply only the rest."""

    type: Literal["batch"]
    rank: int = Field(ge=0)
    gen: U64 = Field(description="Sequence generation of this (pod, rank); a reset starts a new, larger one.")
    seq: U64 = Field(description="vLLM's batch sequence number within the generation.")
    ts: float | None = None
    events: list[BlockEvent]
    part: int = Field(0, ge=0, description="0-based part of a batch published in several (over the message limit)")
    parts: int = Field(1, ge=1, description="how many parts the batch has; the seq is done after the last")
    last_seq: U64 | None = Field(None, description="a run of consecutive batches: the last one's seq (a run is "
                                                   "never in parts)")
    ends: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="a run: per batch, the index in events after its last event (non-decreasing; the last "
                          "is len(events))")

    @model_validator(mode="after")
    def _run_holds_together(self) -> "L1Batch":
        error = run_error(self.model_dump())
        if error:
            raise ValueError(error)
        return self


class L1Reset(_Message):
    """Forget everything known about (pod, rank): the bridge can no longer vouch for it."""

    type: Literal["reset"]
    rank: int = Field(ge=0)
    gen: U64
    next_seq: U64 = Field(description="The vLLM seq of the first batch of the new generation.")
    reason: str = ""


class PodRemoved(_Message):
    """The pod left discovery (for longer than ``ingest.l1.removalGrace``) or was unregistered: drop all of
    its ranks, and retire their generations started before ``gen`` (the bridge's clock when it removed the
    pod): a generation started after it (the pod back, stored before this message by a retry) stays.
    Without ``gen`` (older bridges), every generation of the pod is retired."""

    type: Literal["pod_removed"]
    reason: str = ""
    gen: int | None = Field(None, ge=0)


class RankRemoved(_Message):
    """One data-parallel rank of a pod that stays left (unregistered, or ``dpRanks`` shrank): drop that rank
    only. On the rank's own subject, after its last batch."""

    type: Literal["rank_removed"]
    rank: int = Field(ge=0)
    reason: str = ""
    gen: int | None = Field(None, ge=0)  # as pod_removed's


L1Message = Annotated[Union[L1Batch, L1Reset, PodRemoved, RankRemoved], Field(discriminator="type")]


class L1Envelope(BaseModel):
    """Root model of a message on the L1 stream (for JSON Schema generation and validation)."""

    message: L1Message


class L3Diff(BaseModel):
    """(block, pod) pairs that appeared in / vanished from a Mooncake master's memory segments."""

    model_config = ConfigDict(extra="forbid")
    v: Literal[1] = SCHEMA_VERSION
    type: Literal["l3_diff"]
    master: str
    added: dict[str, list[U64]] = Field(description="pod IP -> block hashes now held")
    removed: dict[str, list[U64]] = Field(description="pod IP -> block hashes no longer held")
    origin: U64 | None = Field(None, description="the publishing bridge's generation; with seq, the master's order")
    seq: U64 | None = Field(None, description="per master and origin: one more per diff part and per full state; "
                                              "indexers apply diffs in this order and refuse repeats")


class L3Full(BaseModel):
    """The whole state of one master; replaces what came before. A state over the message limit comes in
    ``parts`` messages of one ``gen`` (the first with Nats-Rollup: sub), applied once the last is in."""

    model_config = ConfigDict(extra="forbid")
    v: Literal[1] = SCHEMA_VERSION
    type: Literal["l3_full"]
    master: str
    pods: dict[str, list[U64]]
    gen: U64 | None = Field(None, description="one full state's parts share it")
    part: int = Field(0, ge=0, description="0-based index of this part")
    parts: int = Field(1, ge=1, description="how many parts the full state has")
    origin: U64 | None = Field(None, description="the publishing bridge's generation")
    seq: U64 | None = Field(None, description="the master's seq of this full state (all its parts share it): its "
                                              "diffs go on from the next one")


L3Message = Annotated[Union[L3Diff, L3Full], Field(discriminator="type")]


class L3Envelope(BaseModel):
    """Root model of a message on the L3 stream."""

    message: L3Message
