"""How far a request's blocks are cached, per worker and tier: what ``POST /query`` answers (the shape of
NVIDIA Dynamo's standalone indexer and Mooncake RFC #1403).

Per (pod, DP rank), the walk vLLM itself makes: the longest run of blocks from block 0 on the GPU
(``gpu``, the prefix cache); from there on, the run the offloading connector can load from the CPU
(``cpu``: where that run ends); from there, the run on STORAGE (``disk``). A block back on the GPU
after the CPU run does not count: vLLM does not look again. Per pod, ``l3``: the longest run in its
Mooncake segment (the best of its masters). Dynamo 1.6.1 answers the same (checked against it:
tests/test_ecosystem_api.py).

``KeyWalk`` (``match_keys`` in one go) is the reference: a walk over the request's block keys
(computed lazily, so a cold request costs a hash or two) that stops when no worker of any stage is
still matching; fed in slices, it leaves the event loop between them.
``NativeTierQuery`` is the native query (parse, hash and walk without the GIL) where nothing is
offloaded: the three stages are then one, and the seed API's query answers it, over every worker.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from cache_indexer.indexer.hit_rate import KeptCandidates, NativeQuery, Tier, _set_bits
from cache_indexer.indexer.l1_state import OFFLOAD_MEDIA
from cache_indexer.schemas.block_hash import BlockHasher, LoRAKey, MultiModalKey, event_block_hash

#: A pod's ranks and what each holds, in blocks: (gpu, cpu, disk)
RankLevels = dict[int, tuple[int, int, int]]


@dataclass(slots=True)
class TierMatch:
    full_blocks: int
    hashed_blocks: int
    #: pod -> rank -> (gpu, cpu, disk) in blocks, for every worker of the L1 tier that holds any (a pod
    #: or rank not here holds nothing: a fleet of 1,000 pods mostly does not hold a given prompt)
    ranks: dict[str, RankLevels] = field(default_factory=dict)
    #: pod -> blocks in its Mooncake segment, for every pod of the L3 tier that holds any
    l3: dict[str, int] = field(default_factory=dict)

    def only(self, allowed: Callable[[str], bool] | None) -> "TierMatch":
        """The match of the pods ``allowed`` says may answer (the others dropped, in place; None: all)."""
        if allowed is None:
            return self
        for pods in (self.ranks, self.l3):
            for pod in [p for p in pods if not allowed(p)]:
                del pods[pod]
        return self


def _stages(l1: Tier | None) -> list:
    """What each stage of the L1 walk looks blocks up in: the GPU's table, then the CPU's and
    STORAGE's (None where the medium holds nothing: every worker goes straight through)."""
    if l1 is None:
        return []
    media = getattr(l1, "media", None) or {}
    return [l1.index.masks] + [index.masks if (index := media.get(name)) is not None and index.block_count() else None
                               for name in OFFLOAD_MEDIA]


class KeyWalk:
    """The reference walk over a request's block keys (the engines' uint64 block hashes), fed in slices
    (``feed``) so that a caller on the event loop can let other work run between them; ``result`` once
    fed. The workers are those of when it began: one released between two slices (its id perhaps another
    pod's now) stops counting there and is answered 0, as the native query answers a worker cleared
    since it was prepared."""

    def __init__(self, n_blocks: int, l1: Tier | None, l3: Tier | None) -> None:
        self.n_blocks, self.hashed = n_blocks, 0
        self._stages = _stages(l1)
        self._l1_workers = list(l1.workers.items()) if l1 is not None else []
        self._l3_workers = list(l3.workers.items()) if l3 is not None else []
        self._alive = [_mask(self._l1_workers), 0, 0][:len(self._stages)]
        self._ends: list[dict[int, int]] = [{} for _ in self._stages]  # per stage, worker -> where its run ended
        self._l3_table = l3.index.masks if l3 is not None else None
        self._l3_alive = _mask(self._l3_workers)
        self._l3_ends: dict[int, int] = {}
        self._l1_gens = _Generations(l1, self._l1_workers)
        self._l3_gens = _Generations(l3, self._l3_workers)

    def _drop_released(self) -> None:
        """Workers released since the walk began leave it, answered 0 (their ids may be another pod's now)."""
        gone = self._l1_gens.released()
        if gone:
            self._alive = [a & ~gone for a in self._alive]
        gone3 = self._l3_gens.released()
        if gone3:
            self._l3_alive &= ~gone3

    @property
    def done(self) -> bool:
        """Every block walked, or no worker of any stage or of L3 still matching."""
        return self.hashed >= self.n_blocks or not (any(self._alive) or self._l3_alive)

    def feed(self, keys: Iterable[int]) -> bool:
        """Walk on over the next keys (in order, from where the last slice ended); whether to go on."""
        self._drop_released()
        stages, alive, ends, hashed = self._stages, self._alive, self._ends, self.hashed
        for key in keys:
            if hashed >= self.n_blocks or not (any(alive) or self._l3_alive):
                break
            leaving = 0  # workers whose run of the stage before ended at this block: they try this stage's
            for s, table in enumerate(stages):
                a = alive[s] | leaving
                if not a:
                    continue
                m = a & table.get(key, 0) if table is not None else 0
                leaving = a ^ m
                for wid in _set_bits(leaving):
                    ends[s][wid] = hashed
                alive[s] = m
            if self._l3_alive:
                m = self._l3_alive & self._l3_table.get(key, 0)
                for wid in _set_bits(self._l3_alive ^ m):
                    self._l3_ends[wid] = hashed
                self._l3_alive = m
            hashed += 1
        self.hashed = hashed
        return not self.done

    def result(self) -> TierMatch:
        self._drop_released()
        ends, hashed = self._ends, self.hashed
        for s, a in enumerate(self._alive):  # still running at the end: this stage and the ones after end here
            for wid in _set_bits(a):
                for later in range(s, len(self._stages)):
                    ends[later][wid] = hashed
        for wid in _set_bits(self._l3_alive):
            self._l3_ends[wid] = hashed
        out = TierMatch(self.n_blocks, hashed)
        gone, gone3 = self._l1_gens.gone, self._l3_gens.gone
        for (pod, rank), wid in self._l1_workers:
            levels = (0, 0, 0) if gone >> wid & 1 else tuple(ends[s].get(wid, 0) for s in range(3))
            if any(levels):
                out.ranks.setdefault(pod, {})[rank] = levels
        for (pod, _), wid in self._l3_workers:
            if n := 0 if gone3 >> wid & 1 else self._l3_ends.get(wid, 0):
                out.l3[pod] = max(out.l3.get(pod, 0), n)
        return out


def match_keys(keys: Iterable[int], n_blocks: int, l1: Tier | None, l3: Tier | None) -> TierMatch:
    """The reference walk over the request's block keys, in one go (keys are drawn lazily: a chain is
    hashed only as far as the walk goes)."""
    walk = KeyWalk(n_blocks, l1, l3)
    walk.feed(keys)
    return walk.result()


def chain_keys(hasher: BlockHasher, tokens, block_size: int, cache_salt: str, lora: LoRAKey | None = None,
               mm_features: Sequence[MultiModalKey] = ()) -> Iterator[int]:
    """A request's block keys, hashed lazily (a chunk at a time) as they are drawn."""
    return map(event_block_hash, hasher.iter_block_hashes(tokens, block_size, cache_salt=cache_salt or None,
                                                           lora=lora, mm_features=mm_features))


class NativeTierQuery:
    """The match as one native call (the seed API's query over every worker of L1 and L3), where nothing is
    offloaded (the three L1 stages are then one) and the request has no extra keys. ``native`` runs on
    the caller's thread or the query threads (``QueryThreads.run``); ``result`` reads its answer."""

    __slots__ = ("native",)

    #: the fleet's workers (every query asks about every pod), kept while the worker tables stand
    _fleet = KeptCandidates()

    def __init__(self, native: NativeQuery) -> None:
        self.native = native

    @classmethod
    def prepare(cls, hasher: BlockHasher, tokens: bytes | memoryview | array, block_size: int, cache_salt: str,
                l1: Tier | None, l3: Tier | None, lora: LoRAKey | None = None,
                mm_features: Sequence[MultiModalKey] = ()) -> "NativeTierQuery | None":
        """``tokens``: the JSON text of the array (parsed, and checked, by the native call: ValueError) or
        uint64s. None where only ``match_keys`` answers."""
        if lora is not None or mm_features or _offloaded(l1):
            return None
        native = NativeQuery.prepare(hasher, tokens, block_size, cache_salt, None, (l1, l3), True, cls._fleet)
        return None if native is None else cls(native)

    def result(self, out: tuple[int, int, list[list[int]]]) -> TierMatch:
        n_tokens, hashed, (held1, held3) = out
        match = TierMatch(n_tokens // self.native.block_size, hashed)
        ranks, l3 = match.ranks, match.l3
        w = self.native.workers  # one pass over the pods: every query has all of them (1,000 in a fleet)
        for pod, ((a, b), (c, d)), (pod_ranks, _) in zip(w.pods, w.slots, w.ranks):  # (a tier None: empty)
            if b > a:
                if b - a == 1:  # one rank: the usual
                    if n := held1[a]:
                        ranks[pod] = {pod_ranks[0]: (n, n, n)}
                elif held := {rank: (n, n, n) for rank, n in zip(pod_ranks, held1[a:b]) if n}:
                    ranks[pod] = held
            if d > c and (n := max(held3[c:d])):
                l3[pod] = n
        return match


def _offloaded(l1: Tier | None) -> bool:
    """Whether any offload medium holds blocks (the count of the table's headers: no walk, no dict of
    every worker, as this is asked per query)."""
    media = getattr(l1, "media", None) or {}
    return any(index.block_count() for index in media.values())


class _Generations:
    """The generations of a walk's workers when it began, and the mask of those released since."""

    __slots__ = ("_table", "_releases", "_workers", "gone")

    def __init__(self, tier: Tier | None, workers: list[tuple[object, int]]) -> None:
        self._table = tier.workers if tier is not None else None
        self._releases = self._table.releases if self._table is not None else 0
        self._workers = [(wid, self._table.generation(wid)) for _, wid in workers] if workers else []
        self.gone = 0

    def released(self) -> int:
        """Workers released since the last look (a mask); one comparison while nothing was."""
        table = self._table
        if table is None or table.releases == self._releases:
            return 0
        self._releases = table.releases
        now = 0
        for wid, gen in self._workers:
            if table.generation(wid) != gen:
                now |= 1 << wid
        now &= ~self.gone
        self.gone |= now
        return now


def _mask(workers: list[tuple[object, int]]) -> int:
    m = 0
    for _, wid in workers:
        m |= 1 << wid
    return m
