"""The in-memory block index of a tier (L1 and L3 alike): which workers hold which block hashes. An L1
worker is a (pod, data-parallel rank) pair, an L3 one a (pod, Mooncake master) pair.

Two implementations of one index, held equal by tests/test_native_index.py:
- ``NativeBlockIndex`` (where the C module was built, the one replicas use): the tables in native
  memory (indexer/native_table.h: per chunk of 64 workers, hash -> mask; per worker, its hashes, so a
  clear costs the worker's blocks), about 32 bytes an entry, queried without the GIL;
- ``BlockIndex``, the pure-Python reference and fallback: one dict ``block hash (uint64) -> bitmask of
  worker ids``; single-bit masks are shared int objects, so an entry costs the dict slot plus the
  hash's int object (about 80 bytes). Clearing a worker walks the dict once.
A worker is a (pod, rank) pair interned to a small integer; a block held by several workers costs one
entry, not one per worker. Both implementations take the same inputs and refuse the same ones, before
changing anything: worker ids 0..MAX_WORKERS-1 (ints, not bools), block hashes that are uint64 ints.

KV-cache groups: a hybrid model (full attention plus sliding-window layers, say) stores the same block
hash once per group and evicts it per group; the sliding-window group drops old blocks long before the
full-attention group does. A worker holds a block while any of its groups does (the removal refcount
llm-d had to add). Groups are tracked only for workers that have used a group other than 0, in a side
map that records only the entries held by a group set other than {0}: single-group engines, i.e. almost
all of them, pay nothing for it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from contextlib import nullcontext

from cache_indexer.schemas.block_hash import U64_MASK

try:  # the index in native memory (indexer/_native_index.c); without a compiler, BlockIndex alone
    from cache_indexer.indexer import _native_index
except ImportError:
    _native_index = None

_NO_BATCH = nullcontext()
#: Worker ids of a tier: 0..MAX_WORKERS-1 (the native table's bound, kept by the Python index too)
MAX_WORKERS = 1 << 16


class TooManyWorkers(ValueError):
    """Every worker id of a tier is taken: the message that needed one more is refused whole."""


def check_wid(wid) -> None:
    """A worker id both indexes accept (the native table refuses the same, with the same errors)."""
    if type(wid) is not int:
        raise TypeError(f"a worker id is an int, not {type(wid).__name__}")
    if not 0 <= wid < MAX_WORKERS:
        raise ValueError(f"worker id {wid} outside 0..{MAX_WORKERS - 1}")


def u64_hashes(hashes: Iterable[int]) -> array:
    """Block hashes as native uint64s (array 'Q'), all checked before any is used: TypeError for a
    non-int, ValueError for an int outside uint64 (as the native table refuses them)."""
    if type(hashes) is array and hashes.typecode == "Q":
        return hashes
    try:
        return array("Q", hashes if isinstance(hashes, (list, tuple)) else list(hashes))
    except OverflowError:
        raise ValueError("block hashes must be uint64") from None

#: A loaded snapshot's view of an index: per chunk of 64 worker ids, its hashes and masks (native uint64
#: bytes), as ``restore_chunks`` takes them.
Chunks = list[tuple[int, bytes, bytes]]


class WorkerTable:
    """Interns (pod, rank) pairs to small worker ids; ids of workers that hold nothing are reused.

    Every release moves the id's generation on: a walk that looked up a pod's workers before a release
    and reads the index after it (a walk fed in slices, a query prepared on the loop and run on a thread)
    tells from it that the id may name another pod now (``generation``, ``releases``)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], int] = {}
        self._by_pod: dict[str, dict[int, int]] = {}
        self._free: list[int] = []
        self._next = 0
        self._generations: dict[int, int] = {}  # ids released at least once -> how many times
        #: releases so far (a walk compares it first, and looks at its workers' generations only if it moved)
        self.releases = 0
        #: workers interned, restored or released so far: what was read of the table stands while it stays
        self.changes = 0

    def get(self, pod: str, rank: int) -> int | None:
        return self._ids.get((pod, rank))

    def room(self) -> int:
        """Workers that can still be interned (MAX_WORKERS in all)."""
        return MAX_WORKERS - len(self._ids)

    def intern(self, pod: str, rank: int) -> int:
        wid = self._ids.get((pod, rank))
        if wid is None:
            if not self._free and self._next >= MAX_WORKERS:
                raise TooManyWorkers(f"all {MAX_WORKERS} worker ids of the tier are taken: {pod} rank {rank} refused")
            wid = self._free.pop() if self._free else self._next
            if wid == self._next:
                self._next += 1
            self._ids[(pod, rank)] = wid
            self._by_pod.setdefault(pod, {})[rank] = wid
            self.changes += 1
        return wid

    def restore(self, pod: str, rank: int, wid: int) -> None:
        """Re-create an interned worker with its id (snapshot loading)."""
        check_wid(wid)
        self._ids[(pod, rank)] = wid
        self._by_pod.setdefault(pod, {})[rank] = wid
        self.changes += 1
        if wid >= self._next:
            self._free.extend(i for i in range(self._next, wid) if i not in self._ids.values())
            self._next = wid + 1
        elif wid in self._free:
            self._free.remove(wid)

    def release(self, pod: str, rank: int) -> None:
        """The id goes back (the caller cleared it in every index of the tier first: ``TierIndex.release``)."""
        wid = self._ids.pop((pod, rank), None)
        if wid is not None:
            ranks = self._by_pod.get(pod, {})
            ranks.pop(rank, None)
            if not ranks:
                self._by_pod.pop(pod, None)
            self._free.append(wid)
            self._generations[wid] = self._generations.get(wid, 0) + 1
            self.releases += 1
            self.changes += 1

    def generation(self, wid: int) -> int:
        """How many times the id was released: a worker looked up at one generation is gone at another."""
        return self._generations.get(wid, 0)

    def pod_workers(self, pod: str) -> dict[int, int]:
        """rank -> worker id for a pod (empty when the pod is unknown)."""
        return self._by_pod.get(pod, {})

    def pods(self) -> list[str]:
        return list(self._by_pod)

    def items(self) -> Iterable[tuple[tuple[str, int], int]]:
        return self._ids.items()


class BlockIndex:
    """Block hash -> bitmask of workers, with per-worker block counts."""

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self._bits: list[int] = []
        self.worker_blocks: dict[int, int] = {}
        #: worker id -> {block hash: bitmask of KV-cache groups}, for entries not held by group 0 alone
        self.groups: dict[int, dict[int, int]] = {}
        #: worker id -> {block: copies beyond the first}. vLLM's BlockPool does not de-duplicate: one hash
        #: can be cached in several physical blocks, each evicted (BlockRemoved) on its own, and the hash
        #: stays reusable while any copy is cached. The block key is the hash for group 0, (hash, group
        #: bit) for other groups. Only duplicates are recorded, so the common case costs nothing.
        self.copies: dict[int, dict] = {}

    def _copy_added(self, wid: int, key) -> None:
        extra = self.copies.setdefault(wid, {})
        extra[key] = extra.get(key, 0) + 1

    def _copy_removed(self, wid: int, key) -> bool:
        """One copy of several goes: True (the block stays held); False when this was the last one."""
        extra = self.copies.get(wid)
        if not extra or key not in extra:
            return False
        n = extra[key] - 1
        if n:
            extra[key] = n
        else:
            del extra[key]
            if not extra:
                del self.copies[wid]
        return True

    def _leaves(self, wid: int, h: int, gbit: int, held_by: dict[int, int] | None) -> bool:
        """A removal of held block ``h`` from KV-cache group ``gbit``: whether the block leaves the worker
        (False: another physical copy, or another group, still holds it; the bookkeeping is updated)."""
        if held_by is None:
            return not self._copy_removed(wid, h)
        groups = held_by.get(h, 1)
        if not groups & gbit or self._copy_removed(wid, h if gbit == 1 else (h, gbit)):
            return False
        groups ^= gbit
        if groups:  # another group of this worker still holds it
            if groups == 1:
                del held_by[h]
            else:
                held_by[h] = groups
            return False
        held_by.pop(h, None)
        return True

    def _bit(self, wid: int) -> int:
        bits = self._bits
        while len(bits) <= wid:
            bits.append(1 << len(bits))
        return bits[wid]

    def store(self, wid: int, hashes: Iterable[int], group: int | None = None) -> None:
        check_wid(wid)
        hashes = u64_hashes(hashes)
        gbit = 1 << (group or 0)
        held_by = self.groups.get(wid)  # absent: every block of the worker is held by group 0 alone
        if held_by is None and gbit != 1:
            held_by = self.groups[wid] = {}
        bit = self._bit(wid)
        blocks = self.blocks
        get = blocks.get
        added = 0
        for h in hashes:
            m = get(h)
            if m is None or not m & bit:
                blocks[h] = bit if m is None else m | bit
                added += 1
                if gbit != 1:
                    held_by[h] = gbit
            elif held_by is None:  # group 0 holds it already: another physical copy
                self._copy_added(wid, h)
            else:
                held = held_by.get(h, 1)
                if held & gbit:  # this group already holds it: another physical copy
                    self._copy_added(wid, h if gbit == 1 else (h, gbit))
                elif held | gbit != 1:
                    held_by[h] = held | gbit
        if added:
            self.worker_blocks[wid] = self.worker_blocks.get(wid, 0) + added

    def remove(self, wid: int, hashes: Iterable[int], group: int | None = None) -> None:
        check_wid(wid)
        hashes = u64_hashes(hashes)
        gbit = 1 << (group or 0)
        held_by = self.groups.get(wid)
        if held_by is None and gbit != 1:
            return  # this worker's blocks are all group 0's: another group held none of them
        bit = self._bit(wid)
        get = self.blocks.get
        copies = self.copies
        removed = 0
        for h in hashes:
            m = get(h)
            if m is None or not m & bit:
                continue
            if (held_by is not None or wid in copies) and not self._leaves(wid, h, gbit, held_by):
                continue
            self._drop(h, m ^ bit)
            removed += 1
        if removed:
            self.worker_blocks[wid] = self.worker_blocks.get(wid, 0) - removed

    def _drop(self, h: int, rest: int) -> None:
        """Set block ``h``'s mask to ``rest`` (one worker fewer), sharing single-bit masks."""
        if rest:
            self.blocks[h] = self._bits[rest.bit_length() - 1] if rest & (rest - 1) == 0 else rest
        else:
            del self.blocks[h]

    def restore_chunks(self, chunks: Chunks, worker_blocks: dict[int, int],
                       groups: dict[int, dict[int, int]] | None = None, copies: dict[int, dict] | None = None) -> None:
        """Adopt a loaded table; single-bit masks become the shared objects (a C-level map, no loop)."""
        self._bit(max(max(worker_blocks, default=0), 0))
        shared = {b: b for b in self._bits}
        self.blocks = {}
        for c, keys, masks in chunks:
            ka, ma = array("Q"), array("Q")
            ka.frombytes(keys)
            ma.frombytes(masks)
            ks, ms = ka.tolist(), ma.tolist()
            if c == 0 and not self.blocks:
                self.blocks = dict(zip(ks, map(shared.get, ms, ms)))
                continue
            blocks, shift = self.blocks, 64 * c
            for k, m in zip(ks, ms):
                blocks[k] = blocks.get(k, 0) | m << shift
        self.worker_blocks = dict(worker_blocks)
        self._restore_side_maps(groups, copies)

    def _restore_side_maps(self, groups: dict[int, dict[int, int]] | None, copies: dict[int, dict] | None) -> None:
        """The KV-cache groups' and duplicate copies' maps of a loaded snapshot."""
        self.groups = {wid: dict(held_by) for wid, held_by in (groups or {}).items()}
        self.copies = {wid: dict(extra) for wid, extra in (copies or {}).items() if extra}

    def export_chunks(self) -> Chunks:
        """Per chunk of 64 worker ids, its hashes and masks (native uint64 bytes): snapshot format 2."""
        per: dict[int, tuple[array, array]] = {}
        for h, m in self.blocks.items():
            c = 0
            while m:
                if m & U64_MASK:
                    ks, ms = per.setdefault(c, (array("Q"), array("Q")))
                    ks.append(h)
                    ms.append(m & U64_MASK)
                m >>= 64
                c += 1
        return [(c, ks.tobytes(), ms.tobytes()) for c, (ks, ms) in sorted(per.items())]

    @property
    def masks(self):
        """What the hit-rate walk looks masks up in (``.get(hash, default)``)."""
        return self.blocks

    def batch(self):
        """Changes made within appear to concurrent queries at once (nothing to do: queries on this index
        run on the event loop, between messages)."""
        return _NO_BATCH

    def clear(self, wid: int) -> int:
        """Drop every block of one worker; returns how many it held."""
        check_wid(wid)
        self.groups.pop(wid, None)
        self.copies.pop(wid, None)
        held = self.worker_blocks.pop(wid, 0)
        if not held:
            return 0
        bit = self._bit(wid)
        for h, m in [(h, m) for h, m in self.blocks.items() if m & bit]:
            self._drop(h, m ^ bit)
        return held

    def __len__(self) -> int:
        return len(self.blocks)

    def block_count(self) -> int:
        """Block hashes held, for the periodic gauge: here the distinct count (the native index counts a
        hash once per 64-worker chunk holding it: its distinct count walks the table)."""
        return len(self.blocks)

    def entries(self) -> int:
        """Number of (block, worker) pairs held."""
        return sum(self.worker_blocks.values())


class NativeBlockIndex(BlockIndex):
    """The same index with the table in native memory (``_native_index.Table``): 16 bytes a (hash, chunk of
    64 workers) slot and 8 a (block, worker) entry for clearing, where the dict costs about 80; the
    hit-rate query runs over it without the GIL. KV-cache groups and duplicate copies keep their Python
    side maps: the table answers, per stored hash, whether the worker held it already, which is all
    their bookkeeping needs."""

    def __init__(self) -> None:
        self.table = _native_index.Table()
        self.groups: dict[int, dict[int, int]] = {}
        self.copies: dict[int, dict] = {}

    @property
    def blocks(self) -> dict[int, int]:  # type: ignore[override]
        """{hash: worker mask} built from the table: for tests and tools, O(entries)."""
        return self.table.as_dict()

    @property
    def masks(self):
        return self.table

    @property
    def worker_blocks(self) -> dict[int, int]:  # type: ignore[override]
        return self.table.worker_counts()

    def store(self, wid: int, hashes: Iterable[int], group: int | None = None) -> None:
        gbit = 1 << (group or 0)
        held_by = self.groups.get(wid)
        if held_by is None and gbit != 1:
            held_by = self.groups[wid] = {}
        if not isinstance(hashes, (list, tuple, array)):
            hashes = list(hashes)
        added, held_before = self.table.store(wid, hashes)  # checks wid and every hash before storing any
        if held_by is None:
            if added != len(held_before):  # some held already: other physical copies
                for h, dup in zip(hashes, held_before):
                    if dup:
                        self._copy_added(wid, h)
            return
        for h, dup in zip(hashes, held_before):
            if not dup:
                if gbit != 1:
                    held_by[h] = gbit
                continue
            held = held_by.get(h, 1)
            if held & gbit:  # this group already holds it: another physical copy
                self._copy_added(wid, h if gbit == 1 else (h, gbit))
            elif held | gbit != 1:
                held_by[h] = held | gbit

    def remove(self, wid: int, hashes: Iterable[int], group: int | None = None) -> None:
        gbit = 1 << (group or 0)
        held_by = self.groups.get(wid)
        if held_by is None and gbit != 1:
            return  # this worker's blocks are all group 0's: another group held none of them
        if held_by is None and wid not in self.copies:
            self.table.remove(wid, hashes)
            return
        if not isinstance(hashes, (list, tuple, array)):
            hashes = list(hashes)
        drop: dict[int, None] = {}
        for h, held in zip(hashes, self.table.holds(wid, hashes)):
            if not held or h in drop:
                continue
            if self._leaves(wid, h, gbit, held_by):
                drop[h] = None
        if drop:
            self.table.remove(wid, list(drop))

    def clear(self, wid: int) -> int:
        self.groups.pop(wid, None)
        self.copies.pop(wid, None)
        return self.table.clear(wid)

    def restore_chunks(self, chunks: Chunks, worker_blocks: dict[int, int],
                       groups: dict[int, dict[int, int]] | None = None, copies: dict[int, dict] | None = None) -> None:
        """Adopt a loaded table (the per-worker counts follow from the masks)."""
        self.table = _native_index.Table()
        for c, keys, masks in chunks:
            self.table.load(c, keys, masks)
        self._restore_side_maps(groups, copies)

    def export_chunks(self) -> Chunks:
        """As the table holds them, copied without the GIL under its read lock (callable off the loop)."""
        return self.table.export_chunks()

    def batch(self):
        """Queries on other threads see the changes made within all at once: the table, as a context
        manager, holds its write lock throughout (one C call each way)."""
        return self.table

    def __len__(self) -> int:
        return len(self.table)

    def block_count(self) -> int:
        return self.table.counts()[2]  # (entries, bytes, hashes per chunk, clear visits, distinct scans)

    def entries(self) -> int:
        return self.table.counts()[0]

    def memory_bytes(self) -> int:
        """Bytes the native table allocated (the Python side maps excluded)."""
        return self.table.counts()[1]


def new_block_index() -> BlockIndex:
    """The native index where it was built, else the pure-Python one."""
    return NativeBlockIndex() if _native_index is not None else BlockIndex()


class TierIndex:
    """What the L1 and L3 states share, and all the scorer reads of a tier (``hit_rate.Tier``): the
    workers and the block index; each state says itself which pods it ``knows``."""

    def __init__(self) -> None:
        self.workers = WorkerTable()
        self.index = new_block_index()

    @property
    def blocks(self) -> dict[int, int]:
        """{hash: worker mask} (a copy, O(entries), where the index is native)."""
        return self.index.blocks

    def pod_workers(self, pod: str) -> dict[int, int]:
        return self.workers.pod_workers(pod)

    def indexes(self) -> list[BlockIndex]:
        """Every index over this tier's worker ids (L1 adds its offload media)."""
        return [self.index]

    def release(self, pod: str, rank: int) -> None:
        """The worker leaves: cleared in every index of the tier (each native table moves the id's epoch on,
        so a query prepared before cannot count what the id's next owner stores), then its id goes back."""
        wid = self.workers.get(pod, rank)
        if wid is not None:
            for index in self.indexes():
                index.clear(wid)
            self.workers.release(pod, rank)
