"""Hit-ratio computation: the longest consecutive run of a request's full blocks, from block 0, that a
pod holds in a tier, divided by the request's number of full blocks.

The hash chain is computed lazily and shared by all tiers; the walk stops at the first block that no
candidate worker of any tier still matches, so a cold request costs one or two hashes, not the whole
chain. A pod's ratio in a tier is the best of its data-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from schemas.block_hash import BlockHasher

try:  # the C accelerator's fast path of the walk (blocks where no worker drops out)
    from indexer._prefix_walk import walk as _walk_c
except (ImportError, AttributeError):
    _walk_c = None


class Tier(Protocol):
    """What the scorer needs of an index: hash -> worker bitmask, and a pod's workers (rank -> id)."""

    @property
    def blocks(self) -> dict[int, int]: ...

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
          pods: Sequence[str], tiers: Sequence[Tier | None]) -> ScoreResult:
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
        blocks = [t.blocks if t is not None else {} for t in tiers]
        for chunk in hasher.iter_block_hash_chunks(token_ids, block_size, cache_salt=cache_salt or None):
            i = 0
            while i < len(chunk):
                if _walk_c is not None:  # skip, in C, the blocks where every alive worker stays alive
                    j = _walk_c(chunk, i, blocks, alive)
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
