"""How far a request's blocks are cached, per worker and tier: what ``POST /query`` answers (the shape of
NVIDIA Dynamo's standalone indexer and Mooncake RFC #1403).

Per (pod, DP rank), the walk vLLM itself makes: the longest run of blocks from block 0 on the GPU
(``gpu``, the prefix cache); from there on, the run the offloading connector can load from the CPU
(``cpu``: where that run ends); from there, the run on STORAGE (``disk``). A block back on the GPU
after the CPU run does not count: vLLM does not look again. Per pod, ``l3``: the longest run in its
Mooncake segment (the best of its masters). Dynamo 1.6.1 answers the same (checked against it:
tests/test_ecosystem_api.py).

``match_keys`` is the reference: a walk over the request's block keys (computed lazily, so a cold
request costs a hash or two) that stops when no worker of any stage is still matching.
``NativeTierQuery`` is the native query (parse, hash and walk without the GIL) where nothing is
offloaded: the three stages are then one, and the seed API's query answers it, over every worker.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from indexer.block_index import WorkerTable
from indexer.hit_rate import NativeQuery, Tier, _set_bits
from schemas.block_hash import BlockHasher, LoRAKey, MultiModalKey

#: A pod's ranks and what each holds, in blocks: (gpu, cpu, disk)
RankLevels = dict[int, tuple[int, int, int]]


@dataclass(slots=True)
class TierMatch:
    full_blocks: int
    hashed_blocks: int
    #: pod -> rank -> (gpu, cpu, disk) in blocks, for every worker of the L1 tier
    ranks: dict[str, RankLevels] = field(default_factory=dict)
    #: pod -> blocks in its Mooncake segment, for every pod of the L3 tier
    l3: dict[str, int] = field(default_factory=dict)

    def only(self, allowed: Callable[[str], bool]) -> "TierMatch":
        """The match of the pods ``allowed`` says may answer (the others dropped, in place)."""
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
    stages = [l1.index.masks]
    for name in ("CPU", "STORAGE"):
        index = media.get(name)
        stages.append(index.masks if index is not None and index.worker_blocks else None)
    return stages


def match_keys(keys: Iterable[int], n_blocks: int, l1: Tier | None, l3: Tier | None) -> TierMatch:
    """The reference walk over the request's block keys (the engines' uint64 block hashes), lazily."""
    stages = _stages(l1)
    alive = [_all_mask(l1.workers) if l1 is not None else 0, 0, 0][:len(stages)]
    ends: list[dict[int, int]] = [{} for _ in stages]  # per stage, worker -> block where its run ended
    l3_table = l3.index.masks if l3 is not None else None
    l3_alive = _all_mask(l3.workers) if l3 is not None else 0
    l3_ends: dict[int, int] = {}
    hashed = 0
    it: Iterator[int] = iter(keys)
    while hashed < n_blocks and (any(alive) or l3_alive):
        key = next(it, None)
        if key is None:
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
        if l3_alive:
            m = l3_alive & l3_table.get(key, 0)
            for wid in _set_bits(l3_alive ^ m):
                l3_ends[wid] = hashed
            l3_alive = m
        hashed += 1
    for s, a in enumerate(alive):  # still running at the end: this stage and the ones after end here
        for wid in _set_bits(a):
            for later in range(s, len(stages)):
                ends[later][wid] = hashed
    for wid in _set_bits(l3_alive):
        l3_ends[wid] = hashed
    out = TierMatch(n_blocks, hashed)
    if l1 is not None:
        for (pod, rank), wid in l1.workers.items():
            out.ranks.setdefault(pod, {})[rank] = tuple(ends[s].get(wid, 0) for s in range(3))
    if l3 is not None:
        for (pod, _), wid in l3.workers.items():
            out.l3[pod] = max(out.l3.get(pod, 0), l3_ends.get(wid, 0))
    return out


def match_tokens(hasher: BlockHasher, tokens: Sequence[int], block_size: int, cache_salt: str, l1: Tier | None,
                 l3: Tier | None, lora: LoRAKey | None = None, mm_features: Sequence[MultiModalKey] = ()) -> TierMatch:
    """A tokenized request's match: the native query where it covers the request (``NativeTierQuery``),
    else ``match_keys`` over the hash chain."""
    if not isinstance(tokens, array):
        tokens = array("Q", tokens)
    query = NativeTierQuery.prepare(hasher, tokens, block_size, cache_salt, l1, l3, lora, mm_features)
    if query is not None:
        try:
            return query.result(query.native.run())
        except NotImplementedError:
            pass  # a pickle token over 2**31-1: only the Python hasher encodes it
    return match_keys(_chain_keys(hasher, tokens, block_size, cache_salt, lora, mm_features),
                      len(tokens) // block_size, l1, l3)


class NativeTierQuery:
    """The match as one native call (the seed API's query over every worker of L1 and L3), where nothing is
    offloaded (the three L1 stages are then one) and the request has no extra keys. ``native`` runs on
    the caller's thread or the query threads (``QueryThreads.run``); ``result`` reads its answer."""

    __slots__ = ("native", "_pods", "_l1", "_l3")

    def __init__(self, native: NativeQuery, pods: list[str], l1: Tier | None, l3: Tier | None) -> None:
        self.native, self._pods, self._l1, self._l3 = native, pods, l1, l3

    @classmethod
    def prepare(cls, hasher: BlockHasher, tokens: bytes | memoryview | array, block_size: int, cache_salt: str,
                l1: Tier | None, l3: Tier | None, lora: LoRAKey | None = None,
                mm_features: Sequence[MultiModalKey] = ()) -> "NativeTierQuery | None":
        """``tokens``: the JSON text of the array (parsed, and checked, by the native call: ValueError) or
        uint64s. None where only ``match_keys`` answers."""
        if lora is not None or mm_features or _offloaded(l1):
            return None
        pods = list(dict.fromkeys([*(l1.workers.pods() if l1 is not None else ()),
                                   *(l3.workers.pods() if l3 is not None else ())]))
        native = NativeQuery.prepare(hasher, tokens, block_size, cache_salt, pods, (l1, l3), with_ranks=True)
        return None if native is None else cls(native, pods, l1, l3)

    def result(self, out: tuple[int, int, list[list[int]]]) -> TierMatch:
        n_tokens, hashed, _ = out
        match = TierMatch(n_tokens // self.native.call_args[2], hashed)
        for pod, (l1_ranks, l3_ranks) in zip(self._pods, self.native.rank_lengths(out)):
            if self._l1 is not None and l1_ranks:
                match.ranks[pod] = {rank: (n, n, n) for rank, n in l1_ranks.items()}
            if self._l3 is not None and l3_ranks:
                match.l3[pod] = max(l3_ranks.values())
        return match


def _offloaded(l1: Tier | None) -> bool:
    media = getattr(l1, "media", None) or {}
    return any(index.worker_blocks for index in media.values())


def _chain_keys(hasher: BlockHasher, tokens, block_size: int, cache_salt: str, lora, mm_features) -> Iterator[int]:
    for chunk in hasher.iter_block_hash_chunks(tokens, block_size, cache_salt=cache_salt or None, lora=lora,
                                               mm_features=mm_features):
        for digest in chunk:
            yield int.from_bytes(digest[-8:], "big")


def _all_mask(workers: WorkerTable | None) -> int:
    m = 0
    if workers is not None:
        for _, wid in workers.items():
            m |= 1 << wid
    return m

