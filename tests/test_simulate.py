"""The simulated engine's BlockPool model against the index: after every request, the hashes the index
holds for the engine are exactly the ones the engine has cached, within its block budget."""

from __future__ import annotations

import random

from cache_indexer.simulate.workload import DEMO_PROMPT, SimulatedEngine
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.indexer.block_index import BlockIndex


class _Publisher:
    dp_rank = 0


def test_engine_events_keep_the_index_equal_to_its_cache():
    engine = SimulatedEngine(_Publisher(), BlockHasher("sha256_cbor", "0"), 16, 48)
    idx, rng = BlockIndex(), random.Random(7)
    prompts = [DEMO_PROMPT, [rng.randrange(32000) for _ in range(300)]]
    evicted = 0
    for i in range(300):
        tokens = list(rng.choice(prompts)) + [rng.randrange(32000) for _ in range(rng.randint(0, 120))]
        for ev in engine.events_for(tokens):
            if ev["type"] == "BlockStored":
                idx.store(0, ev["block_hashes"])
            else:
                idx.remove(0, ev["block_hashes"])
                evicted += len(ev["block_hashes"])
        assert set(engine.cached) == {h for h, m in idx.blocks.items() if m & 1}, i
        assert engine.used == sum(engine.cached.values()) <= 48
    assert evicted > 0, "the budget made it evict"
