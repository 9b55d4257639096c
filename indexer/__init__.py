"""The indexer: the streams' side. Rebuilds the L1 (GPU prefix cache) and L3 (Mooncake Store) indexes
from the NATS streams (snapshot, then the tail), writes snapshots under a lease, and scores a request's
blocks against them (``hit_rate``).

May import: ``schemas``, ``infra``. Never ``bridge`` (the two meet only on the streams' contract),
``api`` or the program. A new tier is a state here (like ``l3_state``) fed by its stream, and a
``hit_rate.Tier`` for the scorer.
"""
