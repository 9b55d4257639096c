"""The seed API's answer in one native pass (api/_answer_json.c) held equal to the Python path it replaces
on the fast path (``NativeQuery.result`` and ``HitRateApi._answer_body``): the same JSON values, the same
best ratios and unknown candidates for the metrics, whatever the candidates' names hold (they are the
router's strings), and no harm from a ``knows`` that changes what it was given."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.api import app as app_module
from cache_indexer.api.app import UNKNOWN_POD_MESSAGE, HitRateApi
from cache_indexer.indexer.hit_rate import NativeQuery
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.schemas.config import HttpConfig
from tests.conftest import needs_native

BS = 16
_answer_json = app_module._answer_json


@pytest.fixture(autouse=True)
def built():
    needs_native(_answer_json is not None, "the seed API's native answer")


class _Tier:
    def __init__(self, known: set[str]) -> None:
        self.known = known

    def knows(self, pod: str) -> bool:
        return pod in self.known


def candidates(pods: list[str], held: list[tuple[list[int], list[int]]], n_blocks: int, known: set[str]):
    """A native query over ``pods`` whose workers hold ``held[i]`` (per tier, one length a worker), and its
    answer's lengths."""
    slots, lengths = [], [[], []]
    for per_tier in held:
        pod_slots = []
        for t, lens in enumerate(per_tier):
            pod_slots.append((len(lengths[t]), len(lengths[t]) + len(lens)))
            lengths[t] += lens
        slots.append(pod_slots)
    workers = SimpleNamespace(pods=pods, slots=slots, chunks=1)
    query = NativeQuery((b"[]", True, BS, b"", True, []), workers, (_Tier(known), None))
    return query, (n_blocks * BS + BS - 1, 0, lengths)


def reference(query: NativeQuery, out) -> tuple[dict, float, float, int]:
    api = HitRateApi(HttpConfig(), BlockHasher("sha256_cbor", "0"), tiers=lambda: (None, None), ready=lambda: True,
                     metrics=Metrics())
    result = query.result(out)
    scores = result.scores
    return (json.loads(api._answer_body(result, None)), max((s.ratios[0] for s in scores), default=0.0),
            max((s.ratios[1] for s in scores), default=0.0), sum(not s.known for s in scores))


def native(query: NativeQuery, out) -> tuple[dict, float, float, int]:
    body, best_l1, best_l3, unknown = _answer_json.seed_answer(
        query.workers.pods, query.workers.slots, out[2], out[0] // BS, query.knows, UNKNOWN_POD_MESSAGE)
    return json.loads(body), best_l1, best_l3, unknown


_names = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12) | st.sampled_from(
    ["10.0.0.1", 'a"b', "a\\b", "\x00\x1f\x7f", "\n\r\t\b\f", "pod-é-漢字-😀", "\u2028\u2029", ""])
_held = st.tuples(st.lists(st.integers(0, 1 << 20), max_size=4), st.lists(st.integers(0, 1 << 20), max_size=3))


@settings(max_examples=300, deadline=None)
@given(pods=st.lists(st.tuples(_names, _held, st.booleans()), max_size=40), n_blocks=st.integers(0, 1 << 20))
def test_the_native_answer_has_the_python_paths_values(pods, n_blocks):
    query, out = candidates([p for p, _, _ in pods], [h for _, h, _ in pods], n_blocks,
                            {p for p, _, k in pods if k})
    assert native(query, out) == reference(query, out)


def test_a_fleets_answer_is_the_python_paths():
    pods = [f"10.{i >> 8}.{i & 255}.1" for i in range(1000)]
    held = [([i % 700, (i * 7) % 700], [i % 3]) if i % 10 else ([], []) for i in range(1000)]
    query, out = candidates(pods, held, 700, {pods[10]})
    got = native(query, out)
    assert got == reference(query, out)
    assert got[3] == 99 and len(got[0]["server_score_list"]) == 1000


def test_a_name_without_utf8_is_refused_as_msgspec_refuses_it():
    query, out = candidates(["\ud800"], [([1], [])], 4, set())
    with pytest.raises(UnicodeEncodeError):
        native(query, out)
    with pytest.raises(Exception):  # the Python path, which answers then, refuses it too
        reference(query, out)


def test_a_knows_that_changes_its_inputs_changes_nothing_read():
    """``knows`` runs Python between candidates: the lists it was given may change, or be freed, meanwhile
    (the block hasher once kept borrowed pointers across such a call: tests/test_native_safety.py)."""
    pods = [f"p{i}" for i in range(200)]
    slots = [[(0, 0), (0, 0)] for _ in pods]
    lengths = [[], []]

    def knows(pod):
        pods.clear()
        slots.clear()
        for held in lengths:
            held.extend(range(10))
        del lengths[:]
        return True
    body, _, _, unknown = _answer_json.seed_answer(pods, slots, lengths, 4, knows, "")
    assert [s["server_ip"] for s in json.loads(body)["server_score_list"]] == [f"p{i}" for i in range(200)]
    assert unknown == 0


@pytest.mark.parametrize("args", [
    (["p"], [[(0, 2), (0, 0)]], [[1], []], 4),  # a slot past its tier's lengths
    (["p"], [[(-1, 0), (0, 0)]], [[1], []], 4),
    (["p"], [[(0, 1)]], [[1], []], 4),  # one tier's slot of two
    (["p"], [[(0, 1), (0, 0)]], [[1]], 4),  # one tier's lengths
    (["p", "q"], [[(0, 1), (0, 0)]], [[1], []], 4),  # a pod with no slots
    (["p"], [[(0, 1), (0, 0)]], [["1"], []], 4),  # a length that is no int
    (["p"], [[[0, 1], (0, 0)]], [[1], []], 4),  # a slot that is no tuple
    ([1], [[(0, 1), (0, 0)]], [[1], []], 4),  # a name that is no str
    (["p"], [[(0, 1), (0, 0)]], [[-1], []], 4),
])
def test_inputs_out_of_shape_are_refused_not_read(args):
    with pytest.raises((TypeError, ValueError, OverflowError)):
        _answer_json.seed_answer(*args, lambda pod: False, "")
