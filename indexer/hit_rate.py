"""Hit-ratio computation: the longest consecutive run of a request's full blocks, from block 0, that a
pod holds in a tier, divided by the request's number of full blocks.

The hash chain is computed lazily and shared by all tiers; the walk stops at the first block that no
candidate worker of any tier still matches, so a cold request costs one or two hashes, not the whole
chain. A pod's ratio in a tier is the best of its data-parallel ranks.

Two ways to the same answer: ``score`` (pure Python with the C helpers, on the caller's thread: the
reference), and, where the tiers' indexes are native and the hash is sha256, ``NativeQuery``: prepared
(the candidates' workers, read with the GIL held), then run as one native call without the GIL (token
parse, hash chain, walk over every tier), on the event loop or a query thread (api/app.py decides).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cache_indexer.indexer.block_index import BlockIndex, NativeBlockIndex, _native_index
from cache_indexer.schemas.block_hash import PICKLE_ONE_FRAME_TOKENS, BlockHasher, LoRAKey, MultiModalKey, parse_token_array

try:  # the C accelerator's fast path of the walk (blocks where no worker drops out)
    from cache_indexer.indexer._prefix_walk import walk as _walk_c
except (ImportError, AttributeError):
    _walk_c = None

#: The native query can run (built, and libcrypto's sha256 found)
NATIVE_QUERY = _native_index is not None and _native_index.sha256_available()


class Tier(Protocol):
    """What the scorer needs of an index: hash -> worker bitmask, and a pod's workers (rank -> id)."""

    @property
    def index(self) -> BlockIndex: ...

    def pod_workers(self, pod: str) -> dict[int, int]: ...

    def knows(self, pod: str) -> bool: ...  # events were seen for the pod (it may hold nothing now)


@dataclass(slots=True)
class PodScore:
    pod: str
    ratios: list[float]  # one per tier, in the order the tiers were given
    known: bool  # events were seen for the pod (it may hold nothing now)


@dataclass(slots=True)
class ScoreResult:
    full_blocks: int
    hashed_blocks: int
    scores: list[PodScore]


def _set_bits(mask: int):
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def score(hasher: BlockHasher, token_ids: Sequence[int], block_size: int, cache_salt: str,
          pods: Sequence[str], tiers: Sequence[Tier | None], lora: LoRAKey | None = None,
          mm_features: Sequence[MultiModalKey] = ()) -> ScoreResult:
    """``lora`` and ``mm_features``: the request's adapter and multimodal items, which vLLM mixes into the
    blocks' extra keys (hashed by the Python path, block by block)."""
    n_blocks = len(token_ids) // block_size
    pod_workers = [[t.pod_workers(p) if t is not None else {} for t in tiers] for p in pods]
    alive: list[int] = []
    for ti in range(len(tiers)):
        m = 0
        for workers in pod_workers:
            for wid in workers[ti].values():
                m |= 1 << wid
        alive.append(m)
    lengths: list[dict[int, int]] = [{} for _ in tiers]
    hashed = 0
    if n_blocks and any(alive):
        blocks = [t.index.masks if t is not None else {} for t in tiers]
        walk_c = _walk_c if all(type(b) is dict for b in blocks) else None
        for chunk in hasher.iter_block_hash_chunks(token_ids, block_size, cache_salt=cache_salt or None, lora=lora,
                                                   mm_features=mm_features):
            i = 0
            while i < len(chunk):
                if walk_c is not None:  # skip, in C, the blocks where every alive worker stays alive
                    j = walk_c(chunk, i, blocks, alive)
                    hashed += j - i
                    if j == len(chunk):
                        break
                    i = j
                if not _step(int.from_bytes(chunk[i][-8:], "big"), blocks, alive, lengths, hashed):
                    return _result(n_blocks, hashed + 1, pods, pod_workers, tiers, alive, lengths)
                hashed += 1
                i += 1
    return _result(n_blocks, hashed, pods, pod_workers, tiers, alive, lengths)


def _step(key: int, blocks: list[dict[int, int]], alive: list[int], lengths: list[dict[int, int]], hashed: int) -> int:
    """One block of the walk (the reference; the C fast path only skips blocks where this changes
    nothing): workers not holding it drop out with ``hashed`` blocks. Returns whether any is left."""
    any_alive = 0
    for ti, a in enumerate(alive):
        if not a:
            continue
        m = blocks[ti].get(key, 0) & a
        dead = a ^ m
        if dead:
            rec = lengths[ti]
            for wid in _set_bits(dead):
                rec[wid] = hashed
        alive[ti] = m
        any_alive |= m
    return any_alive


def _result(n_blocks: int, hashed: int, pods: Sequence[str], pod_workers, tiers, alive: list[int],
            lengths: list[dict[int, int]]) -> ScoreResult:
    for ti in range(len(tiers)):
        for wid in _set_bits(alive[ti]):
            lengths[ti][wid] = hashed
    scores: list[PodScore] = []
    for pod, workers in zip(pods, pod_workers):
        ratios = []
        for ti in range(len(tiers)):
            best = max((lengths[ti].get(wid, 0) for wid in workers[ti].values()), default=0)
            ratios.append(best / n_blocks if n_blocks else 0.0)
        known = any(workers) or any(t is not None and t.knows(pod) for t in tiers)
        scores.append(PodScore(pod=pod, ratios=ratios, known=known))
    return ScoreResult(full_blocks=n_blocks, hashed_blocks=hashed, scores=scores)


def configure_native_query(digest_memo_bytes: int) -> None:
    """The bound of each query thread's digest memo (``http.digestMemoBytes``; 0: none), for the threads
    that start querying from now on."""
    if NATIVE_QUERY:
        _native_index.set_memo_bytes(digest_memo_bytes)


class CandidateWorkers:
    """The candidates' workers in each tier as a native query takes them: per tier the worker ids in pod
    order, per pod per tier its slice of them (and its ranks, or masters, in that order), the index chunks
    they are in. It depends only on the tiers' worker tables (``WorkerTable.changes``), so a caller may
    keep it while those do not change; each query reads the workers' epochs anew (``Table.candidates``).
    A tier that is None has no workers: every pod's slice of it is empty."""

    __slots__ = ("pods", "wids", "slots", "ranks", "chunks")

    def __init__(self, pods: Sequence[str] | None, tiers: Sequence[Tier | None], with_ranks: bool = False) -> None:
        """``pods``: the candidates; None: every pod of the tiers' worker tables, in order."""
        if pods is None:
            pods = list(dict.fromkeys(p for t in tiers if t is not None for p in t.workers.pods()))
        self.pods = pods
        self.wids: list[list[int] | None] = []
        self.slots: list[list[tuple[int, int]]] = [[] for _ in pods]
        self.ranks: list[list[list[int]]] | None = [[] for _ in pods] if with_ranks else None
        chunks = 0
        for t in tiers:
            if t is None:
                self.wids.append(None)
                for pi in range(len(pods)):
                    self.slots[pi].append((0, 0))
                    if self.ranks is not None:
                        self.ranks[pi].append([])
                continue
            wids: list[int] = []
            for pi, pod in enumerate(pods):
                start = len(wids)
                workers = t.pod_workers(pod)
                wids += workers.values()
                self.slots[pi].append((start, len(wids)))
                if self.ranks is not None:
                    self.ranks[pi].append(list(workers))
            self.wids.append(wids)
            chunks += len({wid >> 6 for wid in wids})
        self.chunks = max(1, chunks)


class KeptCandidates:
    """One ``CandidateWorkers``, kept while the pods asked about and the tiers' worker tables stay the same:
    a router names the same candidates query after query, and /query asks about every pod (reading them
    is O(pods): 0.4-0.9 ms at 1,000)."""

    __slots__ = ("_key", "_workers")

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._workers: CandidateWorkers | None = None

    def of(self, tiers: Sequence[Tier | None], pods: Sequence[str] | None = None,
           with_ranks: bool = False) -> CandidateWorkers:
        """The workers of ``pods`` (None: every pod of the tiers, in order) in ``tiers`` (read anew each time
        where a tier has no worker table to tell its changes by)."""
        tables = tuple(getattr(t, "workers", None) for t in tiers)
        if pods is not None and any(t is not None and w is None for t, w in zip(tiers, tables)):
            return CandidateWorkers(pods, tiers, with_ranks)
        key = (None if pods is None else tuple(pods), tables,
               tuple(w.changes if w is not None else 0 for w in tables), with_ranks)
        if key != self._key:
            self._key, self._workers = key, CandidateWorkers(pods, tiers, with_ranks)
        return self._workers


class NativeQuery:
    """A request's hit-rate query for the native index: ``prepare`` reads the candidates' workers (with
    the GIL held), ``run`` (or ``QueryThreads.run``, on native threads) parses, hashes and walks without
    the GIL and holds no Python state the event loop changes, ``result`` turns the lengths into scores."""

    __slots__ = ("call_args", "chunks", "workers", "_tiers")

    def __init__(self, call_args: tuple, workers: CandidateWorkers, tiers: Sequence[Tier | None]) -> None:
        self.call_args = call_args  # _native_index.query's arguments
        #: the index chunks (64 workers each, over every tier) the walk may look a block up in: its cost a
        #: block grows with them (the API's bound on a query's time on the event loop)
        self.chunks = workers.chunks
        self.workers = workers  # the candidates' workers, in the order of the lengths ``run`` gives per tier
        self._tiers = tiers

    @property
    def block_size(self) -> int:
        """Tokens a block (among ``call_args``, which the native call takes as they are)."""
        return self.call_args[2]

    @classmethod
    def prepare(cls, hasher: BlockHasher, tokens: bytes | memoryview | array, block_size: int, cache_salt: str,
                pods: Sequence[str] | None, tiers: Sequence[Tier | None], with_ranks: bool = False,
                kept: KeptCandidates | None = None) -> "NativeQuery | None":
        """None where only ``score`` answers: an index or hash the native query does not cover.
        ``pods``: the candidates (None: every pod of the tiers); ``with_ranks``: keep each worker's rank,
        for ``rank_lengths``; ``kept``: where the caller keeps the candidates' workers between queries.
        ``tokens``: the JSON text of the token array (bytes-like: parsed, and checked, by ``run``) or
        uint64s (an array of format 'Q'). A salted first block is hashed here (its extra keys are
        Python objects); the ValueError of a malformed array then comes from here."""
        if not NATIVE_QUERY or not hasher.algo.startswith("sha256") or len(hasher.none_hash) != 32:
            return None
        if not hasher.algo.endswith("_cbor") and block_size > PICKLE_ONE_FRAME_TOKENS:
            return None
        if any(t is not None and not isinstance(t.index, NativeBlockIndex) for t in tiers):
            return None
        raw = not isinstance(tokens, array)
        pre = hasher.none_hash
        if cache_salt:
            if raw:
                if parse_token_array is None:
                    return None
                tokens, raw = array("Q", parse_token_array(tokens)), False
            if len(tokens) >= block_size > 0:
                pre += hasher.hash_block(pre, tokens[:block_size].tolist(),
                                         hasher.block_extra_keys(0, block_size, cache_salt))
        workers = kept.of(tiers, pods, with_ranks) if kept is not None else CandidateWorkers(pods, tiers, with_ranks)
        per_tier = [(None, b"") if wids is None else (t.index.table, t.index.table.candidates(wids))
                    for t, wids in zip(tiers, workers.wids)]
        args = (tokens, raw, block_size, pre, hasher.algo.endswith("_cbor"), per_tier)
        return cls(args, workers, tiers)

    def run(self) -> tuple[int, int, list[list[int]]]:
        """(tokens, blocks hashed, per tier the candidates' lengths). ValueError: a malformed token
        array; NotImplementedError: a request only ``score`` can hash (a pickle token over 2**31-1)."""
        return _native_index.query(*self.call_args)

    def rank_lengths(self, out: tuple[int, int, list[list[int]]]) -> list[list[dict[int, int]]]:
        """Per pod, per tier: rank (or master) -> blocks held from block 0 (prepared ``with_ranks``)."""
        lengths = out[2]
        return [[dict(zip(ranks, held[a:b])) for ranks, held, (a, b) in zip(pod_ranks, lengths, pod_slots)]
                for pod_ranks, pod_slots in zip(self.workers.ranks, self.workers.slots)]

    def result(self, out: tuple[int, int, list[list[int]]]) -> ScoreResult:
        """Per pod, per tier: the longest run its workers hold, over the request's blocks; and whether the pod
        is known (it has workers, or a tier saw events of it). One pass over the pods (a router may name
        1,000 candidates)."""
        n_tokens, hashed, lengths = out
        n_blocks = n_tokens // self.block_size
        scores = []
        for pod, slots in zip(self.workers.pods, self.workers.slots):
            ratios = []
            known = False
            for (a, b), held in zip(slots, lengths):
                if b > a:
                    known = True
                    ratios.append((held[a] if b - a == 1 else max(held[a:b])) / n_blocks if n_blocks else 0.0)
                else:
                    ratios.append(0.0)
            scores.append(PodScore(pod, ratios, known or self.knows(pod)))
        return ScoreResult(n_blocks, hashed, scores)

    def knows(self, pod: str) -> bool:
        """Whether a tier saw events of a pod that has no workers in any (``result``'s ``known``)."""
        return any(t is not None and t.knows(pod) for t in self._tiers)
