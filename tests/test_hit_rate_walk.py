"""The hit-rate walk's C fast path (``indexer._prefix_walk.walk``) against the pure-Python reference: the
same ratios and the same number of blocks hashed, for random indexes with holes, two tiers, salts and
worker ids past 64 (masks wider than a machine word)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cache_indexer.indexer.hit_rate as hit_rate
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import needs_native

H = BlockHasher("sha256_cbor", "0")
BS = 4
TOKENS = list(range(1000, 1000 + 40 * BS))  # 40 blocks



@pytest.fixture(autouse=True)
def _native_walk():
    needs_native(hit_rate._walk_c is not None, "the hit-rate walk's C fast path")


def _state(holdings: list[tuple[int, list[int]]], salt: str, extra_workers: int) -> L1State:
    """Workers holding the chain's blocks at the given indexes; ``extra_workers`` others first, so the
    candidates' worker ids can pass 64."""
    st_ = L1State()
    chain = H.event_hashes(TOKENS, BS, cache_salt=salt or None)
    for w in range(extra_workers):
        st_.apply({"type": "batch", "pod": f"10.9.{w // 250}.{w % 250}", "rank": 0, "gen": 1, "seq": 0,
                   "events": [{"kind": "stored", "hashes": [w + 1], "medium": "GPU"}]})
    for pod_i, held in holdings:
        st_.apply({"type": "batch", "pod": f"10.0.0.{pod_i}", "rank": pod_i % 2, "gen": 1, "seq": 0,
                   "events": [{"kind": "stored", "hashes": [chain[i] for i in held], "medium": "GPU"}]})
    return st_


holdings = st.lists(st.tuples(st.integers(1, 12), st.lists(st.integers(0, 39), max_size=40)), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(l1=holdings, l3=holdings, salt=st.sampled_from(["", "s"]), extra=st.sampled_from([0, 70]))
def test_the_c_walk_answers_as_the_python_reference(l1, l3, salt, extra):
    tiers = [_state(l1, salt, extra), _state(l3, salt, 0)]
    pods = [f"10.0.0.{i}" for i in range(1, 13)]
    fast = hit_rate.score(H, TOKENS, BS, salt, pods, tiers)
    c = hit_rate._walk_c
    hit_rate._walk_c = None
    try:
        reference = hit_rate.score(H, TOKENS, BS, salt, pods, tiers)
    finally:
        hit_rate._walk_c = c
    assert fast == reference


def test_walk_rejects_what_it_cannot_read():
    with pytest.raises(TypeError):
        hit_rate._walk_c([b"short"], 0, [{}], [1])
    with pytest.raises(TypeError):
        hit_rate._walk_c([b"x" * 32], 0, [[]], [1])
    with pytest.raises(ValueError):
        hit_rate._walk_c([b"x" * 32], 0, [{}], [1, 2])
    assert hit_rate._walk_c([b"x" * 32] * 3, 0, [{}], [0]) == 3, "no worker alive: nothing can change"


def test_a_known_prefix_through_both_paths():
    tiers = [_state([(1, list(range(20))), (2, list(range(10)) + list(range(11, 40)))], "", 70), None]
    for walk in (hit_rate._walk_c, None):
        c, hit_rate._walk_c = hit_rate._walk_c, walk
        try:
            result = hit_rate.score(H, TOKENS, BS, "", ["10.0.0.1", "10.0.0.2"], tiers)
        finally:
            hit_rate._walk_c = c
        assert [s.ratios[0] for s in result.scores] == [0.5, 0.25] and result.hashed_blocks == 21
