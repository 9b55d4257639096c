"""L1 index snapshots: a compact, fast-loading encoding and their store in NATS.

Encoding: a msgpack header (stream sequence covered, workers, per-worker stream cursors) followed by
raw little-endian uint64 arrays (block hashes, worker bitmasks). Up to 64 workers (format 1) one pair
an index, as every version writes and reads (replicas of both share snapshots during a rolling
upgrade); past 64 workers (format 2) one pair per chunk of 64 workers, as the native table holds and
loads them, copied without the GIL (``L1Snapshot``: the indexer takes it off the event loop). A
replica older than format 2 refuses such a snapshot and rebuilds from the stream. The native index
writes and loads the arrays straight from its tables, the pure-Python one with ``array`` conversions:
no per-entry parsing either way. The offload media (CPU, STORAGE) follow as more pairs of arrays,
described by the header's ``media``: a reader that predates them ignores both.

Store: the object store bucket holds ``l1-<seq>.<nonce>[-<stream tag>]`` objects; the KV key
``snapshot.l1`` points at the newest one and is moved with compare-and-set, so a reader always finds a
complete snapshot and an older writer can never overwrite a newer pointer. Older objects beyond ``keep``
are deleted. Every upload has a name of its own (the nonce): two writers at the same stream seq (the
first paused past its lease while the next lease holder wrote) once wrote the same name, and the
loser's clean-up after its failed compare-and-set deleted the object the pointer named. A writer
deletes only its own upload, and its pruning never the object the pointer names.

Reading: the writer may prune the object a reader is loading (the reader was slow, or two snapshots
came in quick succession). nats-py's ``ObjectStore.get`` then waits forever for chunks that no longer
exist, so objects are read here with a bound on the wait for each chunk; a snapshot that vanishes or
fails its digest is retried from the pointer, which by then names a newer one.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import io
import logging
import sys
import uuid
import zlib
from array import array
from dataclasses import dataclass

import msgpack
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import (KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError,
                            ObjectNotFoundError)

from cache_indexer.infra.event_codec import plain
from cache_indexer.infra.streams import RecordsKv, object_store, unsubscribe_quietly
from cache_indexer.indexer.block_index import BlockIndex, Chunks
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.schemas.block_hash import U64_MASK
from cache_indexer.infra.log_format import describe

log = logging.getLogger(__name__)

#: One merged pair of arrays per index, masks wider than 64 bits in the header: written while every
#: table spans one chunk of 64 workers (then it is what each chunk holds), read by every version.
FORMAT = "cache-indexer-l1-v1"
#: A pair of arrays per chunk of 64 workers, as the native table holds and loads them: written past 64
#: workers, where merging cost a walk of every chunk probing the ones before (O(entries x chunks)).
FORMAT_CHUNKS = "cache-indexer-l1-v2"
CHUNK_SIZE = 512 * 1024  # below the default 1 MB max_payload; fewer chunks than nats-py's 128 KiB
POINTER_KEY = "snapshot.l1"


class L1Snapshot:
    """A snapshot in the making. Taken (``__init__``) on the event loop: the Python-side state (workers,
    cursors, KV-cache groups, copies). ``export`` copies the tables (the native one without the GIL: it
    may run on another thread while the loop serves queries, as long as nothing is applied meanwhile),
    ``encode`` makes the bytes."""

    def __init__(self, state: L1State, stream_seq: int) -> None:
        self.stream_seq = stream_seq
        self.indexes = [(None, state.index)] + [(name, index) for name, index in state.media.items()
                                                if index.block_count()]
        self.header = {"stream_seq": stream_seq,
                       "workers": [[pod, rank, wid] for (pod, rank), wid in state.workers.items()],
                       "cursors": state.cursor_rows()}
        self.sides = [_side(index) for _, index in self.indexes]

    def export(self) -> list[Chunks]:
        return [index.export_chunks() for _, index in self.indexes]

    def encode(self, exported: list[Chunks]) -> bytes:
        return b"".join(self.encode_parts(exported))

    def encode_parts(self, exported: list[Chunks]) -> list[bytes]:
        """The snapshot's bytes as pieces, in order, without joining them: a join of 800 MB (50M entries)
        holds the GIL for a quarter of a second, and the event loop waited for it (``PartsReader``
        gives them to the object store a chunk at a time)."""
        arrays: list[bytes] = []
        parts = []
        merged = all(c == 0 for chunks in exported for c, _, _ in chunks)
        for side, chunks in zip(self.sides, exported):
            rows = []
            for c, keys, masks in chunks:
                arrays += _swap_on_big_endian(keys, masks)
                rows.append([c, len(keys) // 8])
            parts.append({**side, "count": sum(n for _, n in rows), "wide": {}} if merged else {**side, "chunks": rows})
        header = dict(self.header, format=FORMAT if merged else FORMAT_CHUNKS)
        header.update(parts[0])
        media = {name: part for (name, _), part in zip(self.indexes[1:], parts[1:])}
        if media:
            header["media"] = media
        head = msgpack.packb(header, default=plain)  # held messages' hashes may be arrays (decode_packed)
        return [len(head).to_bytes(8, "little"), head, *arrays]


class PartsReader(io.RawIOBase):
    """Bytes given as pieces, read as one file. The object store reads a file's chunks on a worker
    thread (``readinto``): each copy is one chunk, never the whole snapshot."""

    def __init__(self, parts: list[bytes]) -> None:
        self._parts = [memoryview(p).cast("B") for p in parts if len(p)]
        self._i = self._at = 0
        self.size = sum(len(p) for p in self._parts)

    def readable(self) -> bool:
        return True

    async def release(self) -> None:
        """Frees the pieces one at a time, the event loop getting a turn between them: a whole snapshot
        freed at once (800 MB at 50M entries, handed back to the system) held the loop for 50 ms."""
        while self._parts:
            self._parts.pop().release()
            await asyncio.sleep(0)

    def readinto(self, buf) -> int:
        out = memoryview(buf).cast("B")
        n = 0
        while n < len(out) and self._i < len(self._parts):
            part = self._parts[self._i]
            k = min(len(out) - n, len(part) - self._at)
            out[n:n + k] = part[self._at:self._at + k]
            n += k
            self._at += k
            if self._at == len(part):
                self._i, self._at = self._i + 1, 0
        return n


def _side(index: BlockIndex) -> dict:
    """What an index keeps beside its table: per-worker counts, KV-cache groups, duplicate copies."""
    return {"worker_blocks": list(index.worker_blocks.items()),
            "groups": [[wid, list(held_by.items())] for wid, held_by in index.groups.items()],
            "copies": [[wid, list(extra.items())] for wid, extra in index.copies.items()]}


def _swap_on_big_endian(*arrays: bytes | memoryview) -> list[bytes]:
    """uint64 arrays between this machine's byte order and the snapshot's (little-endian): the same swap
    both ways, none on a little-endian machine."""
    if sys.byteorder == "little":
        return [bytes(raw) for raw in arrays]
    out = []
    for raw in arrays:
        a = array("Q", raw)
        a.byteswap()
        out.append(a.tobytes())
    return out


def encode_l1(state: L1State, stream_seq: int) -> bytes:
    """A whole snapshot on the caller's thread."""
    snap = L1Snapshot(state, stream_seq)
    return snap.encode(snap.export())


def decode_l1(data: bytes | memoryview) -> tuple[L1State, int]:
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of new objects, none of them garbage: collections would only slow the load
    try:
        return _decode_l1(data)
    finally:
        if gc_was_enabled:
            gc.enable()


def _decode_l1(data: bytes | memoryview) -> tuple[L1State, int]:
    n = int.from_bytes(data[:8], "little")
    header = msgpack.unpackb(bytes(data[8:8 + n]), raw=False, strict_map_key=False)
    if header.get("format") not in (FORMAT, FORMAT_CHUNKS):
        raise ValueError(f"unknown snapshot format {header.get('format')!r}")
    body = memoryview(data)[8 + n:]
    state = L1State()
    for pod, rank, wid in header["workers"]:
        state.workers.restore(pod, rank, wid)
    body = _restore_index(state.index, header, body)
    for name, part in header.get("media", {}).items():  # absent before the offload media
        index = state.media.get(name)
        if index is None:
            raise ValueError(f"snapshot holds unknown medium {name!r}")
        body = _restore_index(index, part, body)
        state.adopt_offloaded(wid for wid, n in part["worker_blocks"] if n)
    for row in header["cursors"]:  # older snapshots lack the last fields (parts, journal, early_since)
        state.restore_cursor(*row)
    state.loaded_at(header["stream_seq"])
    return state, header["stream_seq"]


def _restore_index(index: BlockIndex, part: dict, body: memoryview) -> memoryview:
    """Load one index's part; the body after its arrays."""
    groups = {wid: dict(pairs) for wid, pairs in part.get("groups", ())}  # absent before KV-cache groups
    copies = {wid: {tuple(k) if isinstance(k, list) else k: n for k, n in pairs}  # absent before copies
              for wid, pairs in part.get("copies", ())}
    if "chunks" in part:  # format 2
        chunks = []
        for c, count in part["chunks"]:
            keys, masks = _swap_on_big_endian(body[:count * 8], body[count * 8:count * 16])
            chunks.append((c, keys, masks))
            body = body[count * 16:]
    else:
        chunks = _chunks(part, body)
        body = body[part["count"] * 16:]
    index.restore_chunks(chunks, dict(part["worker_blocks"]), groups, copies)
    return body


def _chunks(header: dict, body: memoryview) -> list[tuple[int, bytes, bytes]]:
    """The body (one array of hashes, one of 64-bit masks, wider masks in the header) by chunks of 64
    workers, as the index loads them."""
    count = header["count"]
    keys, masks = array("Q"), array("Q")
    keys.frombytes(body[:count * 8])
    masks.frombytes(body[count * 8:count * 16])
    if sys.byteorder != "little":
        keys.byteswap()
        masks.byteswap()
    wide: dict[int, tuple[array, array]] = {}
    for i, raw in header["wide"].items():
        m, k = int.from_bytes(raw, "little"), keys[int(i)]
        masks[int(i)] = m & U64_MASK
        c = 1
        while m := m >> 64:
            if m & U64_MASK:
                ks, ms = wide.setdefault(c, (array("Q"), array("Q")))
                ks.append(k)
                ms.append(m & U64_MASK)
            c += 1
    return [(0, keys.tobytes(), masks.tobytes())] + [(c, ks.tobytes(), ms.tobytes()) for c, (ks, ms) in sorted(wide.items())]


@dataclass(slots=True)
class SnapshotRef:
    name: str
    stream_seq: int
    revision: int
    stream_id: str = ""  # streams.stream_id: a snapshot of a stream since recreated is not ours


def _stream_tag(name: str) -> str:
    """The stream tag of a snapshot's name, ``l1-<seq>[.<nonce>][-<tag>]`` ("" before tags). The nonce
    sits in the seq's part, after a ``.``: versions before it read the same tag from the new names."""
    parts = name.split("-", 2)
    return parts[2] if len(parts) > 2 else ""


def object_name(stream_seq: int, stream_id: str = "") -> str:
    """A new snapshot object's name: its stream seq (zero-padded: names sort by it), a nonce of its own
    (no two uploads share a name, whoever writes them), and the stream's tag."""
    return (f"l1-{stream_seq:012d}.{uuid.uuid4().hex[:12]}"
            + (f"-{zlib.crc32(stream_id.encode()):08x}" if stream_id else ""))


class SnapshotUnreadable(Exception):
    """The object a pointer named vanished or is damaged."""


class SnapshotStore:
    def __init__(self, js, bucket: str, meta_bucket: str, keep: int = 2, *, chunk_timeout: float = 10.0,
                 load_attempts: int = 5, replicas: int = 1) -> None:
        self.js = js
        self.replicas = replicas
        self.bucket = bucket
        self.keep = keep
        self.chunk_timeout = chunk_timeout
        self.load_attempts = load_attempts
        self.failed_loads = 0
        self._obs = None
        self._kv = RecordsKv(js, meta_bucket, replicas)

    async def _stores(self):
        """Each store is looked up until it answers once (one may fail after the other succeeded)."""
        if self._obs is None:
            self._obs = await object_store(self.js, self.bucket, self.replicas)
        return self._obs, await self._kv()

    async def pointer(self) -> SnapshotRef | None:
        _, kv = await self._stores()
        try:
            entry = await kv.get(POINTER_KEY)
        except (KeyNotFoundError, NotFoundError):
            return None
        if not entry.value:
            return None
        p = msgpack.unpackb(entry.value)
        return SnapshotRef(p["name"], p["stream_seq"], entry.revision, p.get("stream_id", ""))

    async def load(self, stream_id: str = "") -> tuple[L1State, int] | None:
        """The newest snapshot, or None when there is none or none could be read.

        None after failures makes the replica rebuild from the stream alone, which reports history lost
        when the stream was compacted: a degraded index beats a replica that never starts (and then
        never writes the next snapshot either)."""
        for attempt in range(1, self.load_attempts + 1):
            try:  # a cluster that just lost a node (or just created the bucket) may not answer at once
                ref = await self.pointer()
            except (NatsTimeoutError, asyncio.TimeoutError):
                self.failed_loads += 1
                log.warning("snapshot pointer (attempt %d of %d): no answer; asking again", attempt, self.load_attempts)
                continue
            if ref is None:
                return None
            if stream_id and ref.stream_id and ref.stream_id != stream_id:
                log.warning("snapshot %s is of the stream as it was before it was recreated: not loaded", ref.name)
                return None
            try:
                blob = await self.read(ref.name)
            except (SnapshotUnreadable, NatsTimeoutError, asyncio.TimeoutError) as exc:
                self.failed_loads += 1
                log.warning("snapshot %s (attempt %d of %d): %s; reading the pointer again", ref.name, attempt,
                            self.load_attempts, describe(exc))
                continue
            try:
                return decode_l1(blob)
            except ValueError as exc:  # whole (its digest held) but of a format this version cannot read:
                self.failed_loads += 1  # a newer writer's, after a rollback. Reading it again will not help
                log.error("snapshot %s cannot be read by this version (%s): rebuilding from the stream alone",
                          ref.name, exc)
                return None
        log.error("no snapshot could be read in %d attempts: rebuilding from the stream alone", self.load_attempts)
        return None

    async def read(self, name: str) -> bytes:
        """An object's bytes, waiting at most ``chunk_timeout`` for each chunk; digest checked."""
        obs, _ = await self._stores()
        try:
            info = await obs.get_info(name)
        except ObjectNotFoundError:
            raise SnapshotUnreadable("deleted before it could be read") from None
        if not info.size:
            return b""
        sub = await self.js.subscribe(f"$O.{self.bucket}.C.{info.nuid}", ordered_consumer=True,
                                      pending_msgs_limit=-1, pending_bytes_limit=-1)
        parts: list[bytes] = []
        digest = hashlib.sha256()
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.chunk_timeout)
                except NatsTimeoutError:
                    raise SnapshotUnreadable(f"no chunk for {self.chunk_timeout}s after {len(parts)} of "
                                             f"{info.chunks} (deleted while being read)") from None
                parts.append(msg.data)
                digest.update(msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await unsubscribe_quietly(sub)
        expected = base64.urlsafe_b64decode(info.digest.split("=", 1)[1]) if info.digest else None
        if expected is not None and digest.digest() != expected:
            raise SnapshotUnreadable("digest mismatch")
        return b"".join(parts)

    async def save(self, blob: bytes | PartsReader, stream_seq: int, stream_id: str = "") -> bool:
        """Upload, then move the pointer by CAS; False when a newer snapshot of the same stream exists."""
        obs, kv = await self._stores()
        current = await self.pointer()
        if current is not None and current.stream_seq >= stream_seq and current.stream_id == stream_id:
            return False
        name = object_name(stream_seq, stream_id)  # ours alone: the clean-up below deletes nobody else's
        meta = api.ObjectMeta(name=name, headers={"Stream-Seq": str(stream_seq), "Format": FORMAT},
                              options=api.ObjectMetaOptions(max_chunk_size=CHUNK_SIZE))
        await obs.put(name, blob, meta=meta)
        value = msgpack.packb({"name": name, "stream_seq": stream_seq, "stream_id": stream_id})
        try:
            if current is None:
                await kv.create(POINTER_KEY, value)
            else:
                await kv.update(POINTER_KEY, value, last=current.revision)
        except KeyWrongLastSequenceError:  # another writer moved it meanwhile: our upload is nobody's
            await obs.delete(name)
            return False
        await self._prune(name)
        return True

    async def _prune(self, newest: str) -> None:
        """Delete the oldest objects beyond ``keep``: never ``newest`` (ours), nor the one the pointer names
        when asked just before each deletion (this writer may have been paused past its lease meanwhile,
        and the next lease holder's snapshot may sort before ours: one of a stream recreated since)."""
        obs, _ = await self._stores()
        try:
            # snapshots of a stream since recreated (another tag after the seq) go first, then by seq
            tag = _stream_tag(newest)
            names = sorted((o.name for o in await obs.list() if not o.deleted and o.name.startswith("l1-")),
                           key=lambda n: (_stream_tag(n) == tag, n))
        except Exception:
            return
        for name in names[:-self.keep] if self.keep > 0 else []:
            if name == newest:
                continue
            try:
                pointed = await self.pointer()
                if pointed is None or pointed.name == name:
                    continue  # unreadable or moved to it: kept (the next prune looks again)
                await obs.delete(name)
            except Exception as exc:
                log.debug("prune %s: %s", name, exc)
