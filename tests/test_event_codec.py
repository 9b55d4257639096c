"""The msgpack encoding of stream messages writes exactly what msgpack.packb writes (the bridge packs with
msgspec's encoder for speed; indexers of earlier versions, and ``events decode``, read the same bytes).
A few seconds."""

from __future__ import annotations

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.infra.event_codec import MSGPACK, decode
from cache_indexer.simulate.vllm_engine import batch_payload, removed, stored
from cache_indexer.bridge.vllm_events import decode_batch

_scalars = (st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=False)
            | st.text(max_size=300, alphabet=st.characters(max_codepoint=0x3ff)))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=20) | st.dictionaries(st.text(max_size=40), inner,
                                                                                                 max_size=8), max_leaves=30)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=40), _values, max_size=10))
def test_msgpack_encoding_is_msgpack_packb_byte_for_byte(message):
    assert MSGPACK.encode(message) == msgpack.packb(message)


def test_a_batch_message_of_decoded_vllm_events_is_packb_byte_for_byte():
    hashes = [(1 << 64) - 1 - i * 7919 for i in range(300)]
    batch = decode_batch(batch_payload([removed([h]) for h in hashes[:200]]
                                       + [stored(hashes[200:], parent=hashes[0], block_size=16)], ts=1764932400.25))
    message = {"v": 1, "type": "batch", "pod": "10.0.0.1", "rank": 0, "gen": 1_764_900_000_000_000_000, "seq": 12,
               "ts": batch.ts, "events": batch.events}
    assert MSGPACK.encode(message) == msgpack.packb(message)
    assert decode(MSGPACK.encode(message)) == message
