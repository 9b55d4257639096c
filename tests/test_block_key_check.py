"""The bridge notices a blockKey that does not match the engines (every ratio would silently be 0), from
real vLLM payloads and end to end through ZMQ, and says which setting the engines use."""

from __future__ import annotations

import asyncio
import logging

import pytest

from cache_indexer.bridge.block_key_check import BlockKeyCheck, diagnose, matches
from cache_indexer.bridge.endpoint import Endpoint
from cache_indexer.bridge.l1_sequencer import L1Sequencer
from cache_indexer.bridge.vllm_events import HashProbe, decode_batch
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.schemas.config import BlockKeyConfig
from tests.conftest import VLLM_EVENTS as EVENTS, make_config, wait_for
from tests.l1_stack import L1Stack
from cache_indexer.simulate.vllm_engine import batch_payload, stored



def probe_of(name: str) -> HashProbe | None:
    return decode_batch((EVENTS / name).read_bytes(), want_probe=True).probe


def test_real_payloads_give_probes_only_where_the_hash_depends_on_tokens_alone():
    assert probe_of("01_block_stored_with_parent.bin") == HashProbe([9707, 0, 358, 3900], 8503671992601869701)
    assert probe_of("06_bytes_hashes.bin") is not None, "the bytes form of the hash is probed too"
    assert probe_of("02_block_stored_lora_salt.bin") is None, "LoRA and salt are extra keys: no probe"
    assert probe_of("07_cpu_offload_events.bin") is None, "CPU / STORAGE placeholders: no probe"
    assert probe_of("legacy/legacy_0.14.0_mixed.bin") is None, "no extra_keys field: a salt may hide there"
    assert decode_batch((EVENTS / "01_block_stored_with_parent.bin").read_bytes()).probe is None, "only on demand"


def test_the_engines_setting_matches_and_a_wrong_one_is_named(caplog):
    probe = probe_of("01_block_stored_with_parent.bin")  # vLLM 0.33, sha256_cbor, PYTHONHASHSEED=0
    metrics = Metrics()
    right = BlockKeyCheck(BlockKeyConfig(hashAlgo="sha256_cbor", pythonHashSeed="0"), metrics)
    assert right.offer("127.0.0.1", probe) is True
    assert right.offer("127.0.0.1", probe) is None, "one check per pod per interval"
    with caplog.at_level(logging.ERROR):
        wrong = BlockKeyCheck(BlockKeyConfig(hashAlgo="sha256", pythonHashSeed=None), metrics)
        assert wrong.offer("127.0.0.2", probe) is False
    assert "hashAlgo=sha256_cbor, pythonHashSeed='0'" in caplog.text
    assert metrics.block_key_checks.labels("match")._value.get() == 1
    assert metrics.block_key_checks.labels("mismatch")._value.get() == 1
    assert metrics.block_key_mismatched_pods._value.get() == 1
    wrong.forget("127.0.0.2")
    assert metrics.block_key_mismatched_pods._value.get() == 0


def test_an_engine_hashing_with_lookahead_tokens_is_told_apart():
    h = BlockHasher("sha256_cbor", "0")
    tokens = list(range(200, 216)) + [7]  # one block and the token after it
    engine_hash = h.event_hashes(tokens, 16, lookahead_tokens=1)[0]
    payload = batch_payload([dict(stored([engine_hash], token_ids=tokens[:16]), lookahead_token_ids=[[7]])])
    probe = decode_batch(payload, want_probe=True).probe
    assert probe.lookahead and not matches(h, probe)
    assert "disable_lookahead_block_hashes" in diagnose(probe, "0")


@pytest.mark.parametrize("scale", [2, 4])
def test_a_hybrid_models_larger_group_block_matches_by_its_last_constituent(scale):
    h = BlockHasher("sha256_cbor", "0")
    tokens = list(range(100, 116))
    last = h.event_hashes(tokens, 16 // scale)[-1]  # what a group of block size 16 reports at hash size 16/scale
    assert matches(h, HashProbe(tokens, last))
    assert not matches(h, HashProbe(tokens, last ^ 1))


async def test_a_misconfigured_bridge_reports_the_pods_it_cannot_match(nats_url, stream_prefix):
    cfg = make_config(nats_url, stream_prefix, blockKey={"pythonHashSeed": "0"})
    stack = await L1Stack(cfg).start()
    try:
        tokens = list(range(7000, 7032))
        ok_engine, other_engine = stack.engine("127.0.0.31"), stack.engine("127.0.0.32")
        await stack.connect((ok_engine, "127.0.0.31", 0), (other_engine, "127.0.0.32", 0))
        good = BlockHasher("sha256_cbor", "0").event_hashes(tokens, 16)
        bad = BlockHasher("sha256", "0").event_hashes(tokens, 16)  # an engine left on vLLM's default algorithm
        await ok_engine.publish([stored(good, token_ids=tokens)])
        await other_engine.publish([stored(bad, token_ids=tokens)])
        m = stack.bridge_metrics
        await wait_for(lambda: m.block_key_checks.labels("mismatch")._value.get() == 1
                       and m.block_key_checks.labels("match")._value.get() == 1, 10, "both pods checked")
        assert m.block_key_mismatched_pods._value.get() == 1
        assert stack.bridge.block_key_check.mismatched == {"127.0.0.32"}
    finally:
        await stack.stop()


class _Sink:
    """Stands in for the stream (the sequencer's runs are not published here)."""

    async def run(self, *args, **kw):
        pass


def test_a_due_check_keeps_batches_that_cannot_hold_a_probe_on_the_usual_path():
    """A check stays due until a probe comes, and on a real fleet almost every store has a parent: the
    sequencer's usual path (no coroutine) must still take those batches (it took none while a check was due:
    a real trace's every batch went through the slower path after the first 30 s); a parentless GPU store
    goes to the probe's path, and its probe is checked. Milliseconds."""
    metrics = Metrics()
    check = BlockKeyCheck(BlockKeyConfig(hashAlgo="sha256_cbor", pythonHashSeed="0"), metrics)
    seq = L1Sequencer(Endpoint("10.0.0.7", 0, "tcp://127.0.0.1:1", None), _Sink(), metrics, None, 64, 1 << 20, check)
    seq.gen, seq.last, seq.last_live = 3, 4, 4
    assert check.due("10.0.0.7")
    probing = (EVENTS / "01_block_stored_with_parent.bin").read_bytes()
    assert decode_batch(probing, want_probe=True).probe is not None  # parentless: a probe
    child = batch_payload([stored([11, 12], parent=10, block_size=4)])
    assert seq.take_usual(5, child), "a store with a parent cannot hold a probe: the usual path takes it"
    assert seq.last == 5
    assert not seq.take_usual(6, probing), "a parentless GPU store: the probe's path"
    assert seq.last == 5
    asyncio.run(seq.on_message(6, probing))
    assert seq.last == 6 and not check.due("10.0.0.7"), "its probe was checked"
    assert metrics.block_key_checks.labels("match")._value.get() == 1
