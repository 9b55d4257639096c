"""Block hashing against vLLM's own vectors, plus properties of the chain."""

from __future__ import annotations

import hashlib
import json
import pickle
from array import array

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.schemas.block_hash import (PICKLE_ONE_FRAME_TOKENS, BlockHasher, LoRAKey, MultiModalKey, event_block_hash,
                                normalize_event_hash)
from tests.conftest import DATA, needs_native

VECTORS = json.loads((DATA / "vllm" / "vllm-block-hashes.json").read_text())
CASES = [(c, "tagged") for c in VECTORS["primary_cases"]] + [(c, "untagged") for c in VECTORS["legacy_untagged_cases"]]


def _hasher(case: dict, encoding: str) -> BlockHasher:
    return BlockHasher(case["hash_algo"], case["PYTHONHASHSEED"], encoding)


def _kwargs(case: dict) -> dict:
    lora = case["lora"]
    return {"cache_salt": case["cache_salt"],
            "lora": LoRAKey(lora["lora_name"], lora["lora_path"]) if lora else None,
            "mm_features": [MultiModalKey(m["identifier"], m["offset"], m["length"]) for m in case["mm_features"] or []],
            "lookahead_tokens": case["num_hash_lookahead_tokens"]}


@pytest.mark.parametrize("case,encoding", CASES, ids=[f"{e}:{c['id']}" for c, e in CASES])
def test_vllm_vectors(case, encoding):
    h = _hasher(case, encoding)
    assert h.none_hash.hex() == case["none_hash_hex"]
    digests = h.block_hashes(case["token_ids"], case["block_size"], **_kwargs(case))
    assert len(digests) == case["num_full_blocks"] == len(case["blocks"])
    for got, block in zip(digests, case["blocks"]):
        assert got.hex() == block["block_hash_hex"]
        assert event_block_hash(got) == block["event_block_hash_int"]
        assert normalize_event_hash(bytes.fromhex(block["event_block_hash_bytes_hex"])) == block["event_block_hash_int"]


@pytest.mark.parametrize("case,encoding", CASES, ids=[f"{e}:{c['id']}" for c, e in CASES])
def test_vllm_vectors_serialized_input(case, encoding):
    """The exact bytes fed to the digest, block by block, as vLLM serialised them."""
    h = _hasher(case, encoding)
    kw = _kwargs(case)
    parent = None
    for block in case["blocks"]:
        extra = json.loads(json.dumps(block["extra_keys_json"]))
        rebuilt = h.block_extra_keys(block["token_start"], block["token_end"] + kw["lookahead_tokens"],
                                     kw["cache_salt"], kw["lora"], kw["mm_features"])
        if kw["lookahead_tokens"]:
            la = case["token_ids"][block["token_end"]: block["token_end"] + kw["lookahead_tokens"]]
            rebuilt = (rebuilt, *la)
        assert json.loads(json.dumps(rebuilt)) == extra
        data = h.serialize((parent or h.none_hash, tuple(block["token_ids"]), rebuilt))
        assert data.hex() == block["serialized_input_hex"]
        parent = bytes.fromhex(block["block_hash_hex"])


def test_unset_seed_uses_vllm_default_for_sha256():
    assert BlockHasher("sha256_cbor", None).none_hash == hashlib.sha256(cbor2.dumps("vllm-none-hash")).digest()
    assert BlockHasher("sha256", None).none_hash == hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=5)).digest()


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_unset_seed_is_refused_for_xxhash(algo):
    with pytest.raises(ValueError, match="random"):
        BlockHasher(algo, None)


def test_normalize_event_hash_forms():
    assert normalize_event_hash(-1) == (1 << 64) - 1  # builtin-hash era: signed 64-bit
    assert normalize_event_hash(5) == 5
    assert normalize_event_hash(b"\x00" * 24 + (7).to_bytes(8, "big")) == 7
    with pytest.raises(TypeError):
        normalize_event_hash("7")


def _reference_chain(h: BlockHasher, tokens, bs, salt):
    """Straight from the spec: generic serialiser, one block at a time."""
    out, parent = [], None
    for i in range(len(tokens) // bs):
        extra = h.block_extra_keys(i * bs, (i + 1) * bs, salt)
        parent = h.hash_block(parent, tokens[i * bs:(i + 1) * bs], extra)
        out.append(parent)
    return out


tokens_st = st.lists(st.integers(min_value=0, max_value=(1 << 40)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.one_of(st.integers(min_value=0, max_value=1 << 70), st.integers(0, 300)), max_size=80),
       bs=st.integers(1, 9), salt=st.one_of(st.none(), st.text(max_size=5)),
       algo=st.sampled_from(["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"]), accelerate=st.booleans())
def test_fast_paths_equal_reference(tokens, bs, salt, algo, accelerate):
    h = BlockHasher(algo, "0", accelerate=accelerate)
    assert h.block_hashes(tokens, bs, cache_salt=salt) == _reference_chain(h, tokens, bs, salt)


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256", "xxhash", "xxhash_cbor"])
def test_accelerator_is_built_and_exact_on_long_chains(algo):
    from cache_indexer.schemas import block_hash

    needs_native(block_hash._blockhash is not None, "the block hasher's C accelerator")
    tokens = [(i * 7919) % 152_000 for i in range(5000)] + [0, 23, 24, 255, 256, 65535, 65536, 2**31, 2**32]
    fast, slow = BlockHasher(algo, "0"), BlockHasher(algo, "0", accelerate=False)
    for bs in (1, 3, 4, 16, 128):
        assert fast.block_hashes(tokens, bs) == slow.block_hashes(tokens, bs) == _reference_chain(slow, tokens, bs, None)


BOUNDARIES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63, 2**64 - 1]


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.one_of(st.sampled_from(BOUNDARIES), st.integers(0, 2**64 - 1), st.integers(0, 200_000)),
                       max_size=90),
       bs=st.sampled_from([1, 2, 5, 16]), algo=st.sampled_from(["sha256_cbor", "sha256"]), native=st.booleans())
def test_token_array_and_native_sha256_paths_equal_the_reference(tokens, bs, algo, native):
    """The API hands the hasher an array('Q') (parsed from JSON in C); the encoders for it and libcrypto's
    sha256 (on Linux) must give exactly the reference bytes, token values at every encoding boundary."""
    from array import array

    from cache_indexer.schemas import block_hash

    accel = block_hash._blockhash
    needs_native(accel is not None, "the block hasher's C accelerator")
    was = accel.native_sha256()
    try:
        accel.native_sha256(native)
        h = BlockHasher(algo, "0")
        expected = _reference_chain(BlockHasher(algo, "0", accelerate=False), tokens, bs, None)
        assert h.block_hashes(array("Q", tokens), bs) == h.block_hashes(tokens, bs) == expected
    finally:
        accel.native_sha256(was)


def test_native_sha256_is_active_on_linux():
    import sys

    from cache_indexer.schemas import block_hash

    if not sys.platform.startswith("linux") or block_hash._blockhash is None:
        pytest.skip("libcrypto is used directly on Linux only")
    assert block_hash._blockhash.native_sha256(), "libcrypto was not found: sha256 falls back to hashlib (slower)"


@settings(max_examples=100, deadline=None)
@given(tokens=tokens_st, bs=st.integers(1, 9), cut=st.integers(0, 80))
def test_chain_is_prefix_stable(tokens, bs, cut):
    """Block i depends only on tokens[: (i+1)*bs]: a prefix of the request has a prefix of the chain."""
    h = BlockHasher("sha256_cbor", "0")
    full = h.block_hashes(tokens, bs)
    assert h.block_hashes(tokens[:cut], bs) == full[: min(cut, len(tokens)) // bs]
    assert len(full) == len(tokens) // bs  # only full blocks


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 50000), min_size=2, max_size=40), bs=st.integers(1, 4),
       salt=st.text(min_size=1, max_size=5))
def test_salt_changes_every_block_through_the_chain_but_only_keys_the_first(tokens, bs, salt):
    h = BlockHasher("sha256_cbor", "0")
    plain, salted = h.block_hashes(tokens, bs), h.block_hashes(tokens, bs, cache_salt=salt)
    assert all(a != b for a, b in zip(plain, salted))
    for i in range(1, len(tokens) // bs):
        assert h.block_extra_keys(i * bs, (i + 1) * bs, salt) is None
    if plain:
        assert h.block_extra_keys(0, bs, salt) == (("cache_salt", salt),)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 50000), min_size=8, max_size=40), pos=st.integers(0, 39))
def test_changing_a_token_changes_its_block_and_all_later_ones(tokens, pos):
    bs = 4
    pos %= len(tokens)
    h = BlockHasher("sha256_cbor", "0")
    changed = list(tokens)
    changed[pos] += 1
    a, b = h.block_hashes(tokens, bs), h.block_hashes(changed, bs)
    blk = pos // bs
    assert a[:blk] == b[:blk]
    assert all(x != y for x, y in zip(a[blk:], b[blk:]))


def test_iteration_is_lazy():  # noqa: D103
    h = BlockHasher("sha256_cbor", "0")
    it = h.iter_block_hashes(list(range(1 << 16)), 16)
    first = next(it)
    assert first == h.hash_block(None, list(range(16)))


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("token,sizes", [
    (100000, range(13090, 13111, 5)),  # BININT tokens: CPython's pickle starts a second frame near 13100
    (1 << 40, range(8180, 8201, 5)),   # LONG1 tokens: near 8190
    (7, range(PICKLE_ONE_FRAME_TOKENS - 2, PICKLE_ONE_FRAME_TOKENS + 3)),  # where the C path stops
])
def test_pickle_blocks_on_both_sides_of_a_frame_boundary_match_pickle_itself(algo, token, sizes):
    """The reported case: sha256, seed "0", block_size 13100, tokens [100000] * 13100."""
    h = BlockHasher(algo, "0")
    for bs in sizes:
        tokens = [token] * (2 * bs)
        expect = []
        parent = h.none_hash
        for i in range(2):
            parent = h.hash_object((parent, tuple(tokens[i * bs:(i + 1) * bs]), None))  # pickle.dumps itself
            expect.append(parent)
        assert h.block_hashes(tokens, bs) == expect, bs
        assert h.block_hashes(array("Q", tokens), bs) == expect, bs


def test_the_reported_13100_token_block():
    got = BlockHasher("sha256", "0").block_hashes([100000] * 13100, 13100)[0].hex()
    assert got == "d1a05c96670ae6d41d28dc37c2eaa68e37e9bdf5b9b8876c2c9e391a683046fc"
