"""The API's answers in one native pass (api/_answer_json.c) held equal to the Python paths they replace
on the fast path: the seed API's (``NativeQuery.result`` and ``HitRateApi._answer_body``: the same JSON
values, the same best ratios and unknown candidates for the metrics) and /query's (``NativeTierQuery.result``,
``TierMatch.only`` and ``answer``: the same values and instances in the same order), whatever the pods'
names hold (a router's strings), with no harm from a callback that changes what it was given."""

from __future__ import annotations

import json
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_indexer.api import app as app_module
from cache_indexer.api.app import UNKNOWN_POD_MESSAGE, HitRateApi
from cache_indexer.api.tiered_query import answer, native_answer
from cache_indexer.indexer.hit_rate import NativeQuery
from cache_indexer.indexer.tier_match import NativeTierQuery
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


# -- /query (api/tiered_query.py) ------------------------------------------------------------------------

def tiered(pods: list[str], held: list[tuple[list[tuple[int, int]], list[int]]]):
    """A native /query over ``pods`` whose L1 workers are ``held[i][0]`` ((rank, length) each) and L3
    workers (masters) hold ``held[i][1]``, and its answer's lengths."""
    slots, ranks, lengths = [], [], [[], []]
    for l1, l3 in held:
        slots.append([(len(lengths[0]), len(lengths[0]) + len(l1)), (len(lengths[1]), len(lengths[1]) + len(l3))])
        ranks.append([[r for r, _ in l1], list(range(len(l3)))])
        lengths[0] += [n for _, n in l1]
        lengths[1] += l3
    workers = SimpleNamespace(pods=pods, slots=slots, ranks=ranks, chunks=1)
    query = NativeTierQuery(NativeQuery((b"[]", True, BS, b"", True, []), workers, (None, None)))
    return query, (0, 0, lengths)


def tiered_reference(query, out, block_size, allowed):
    return json.loads(msgspec.json.encode(answer(query.result(out).only(allowed), block_size)))


_ranked = st.tuples(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1 << 20)), max_size=4, unique_by=lambda r: r[0]),
                    st.lists(st.integers(0, 1 << 20), max_size=3))


@settings(max_examples=300, deadline=None)
@given(pods=st.lists(st.tuples(_names, _ranked, st.booleans()), max_size=40, unique_by=lambda p: p[0]),
       block_size=st.sampled_from([0, 1, 16, 256]), scoped=st.booleans())
def test_the_native_query_answer_has_the_python_paths_values(pods, block_size, scoped):
    query, out = tiered([p for p, _, _ in pods], [h for _, h, _ in pods])
    barred = {p for p, _, bar in pods if bar}
    allowed = (lambda pod: pod not in barred) if scoped else None
    w = query.native.workers
    got = json.loads(_answer_json.tiered_answer(w.pods, w.slots, w.ranks, out[2], block_size, allowed))
    assert got == tiered_reference(query, out, block_size, allowed)
    assert list(got["instances"]) == list(tiered_reference(query, out, block_size, allowed)["instances"])


def test_a_fleets_query_answer_is_the_python_paths():
    pods = [f"10.{i >> 8}.{i & 255}.1" for i in range(1000)]
    held = [([(0, i % 700), (1, (i * 7) % 700)] if i % 10 else [], [i % 3] if i % 4 else []) for i in range(1000)]
    query, out = tiered(pods, held)
    w = query.native.workers
    body = _answer_json.tiered_answer(w.pods, w.slots, w.ranks, out[2], BS, None)
    assert json.loads(body) == tiered_reference(query, out, BS, None)
    assert native_answer(query, out, BS, None) == body


def test_a_pod_name_without_utf8_falls_back_to_the_python_path():
    query, out = tiered(["\ud800"], [([(0, 3)], [])])
    with pytest.raises(Exception):
        native_answer(query, out, BS, None)  # msgspec refuses it as before


@pytest.mark.parametrize("args", [
    (["p"], [[(0, 2), (0, 0)]], [[[0], []]], [[1], []], 16, None),  # a slot past its tier's lengths
    (["p"], [[(0, 1)]], [[[0], []]], [[1], []], 16, None),
    (["p"], [[(0, 1), (0, 0)]], [[[0]]], [[1], []], 16, None),  # one tier's ranks
    (["p"], [[(0, 1), (0, 0)]], [[["r"], []]], [[1], []], 16, None),  # a rank that is no int
    (["p"], [[(0, 1), (0, 0)]], [[[0], []]], [[1 << 62], []], 16, None),  # tokens past 64 bits
    (["p"], [[(0, 1), (0, 0)]], [[[0], []]], [[1], []], 16, "not callable"),
    (["p"], [[(0, 1), (0, 0)]], [[[True], []]], [[1], []], 16, None),  # a bool rank (Python writes "True")
    (["p"], [[(0, 1), (0, 0)]], [[[0], []]], [[1], []], -16, None),
])
def test_query_inputs_out_of_shape_are_refused_not_read(args):
    with pytest.raises((TypeError, ValueError, OverflowError)):
        _answer_json.tiered_answer(*args)


def test_an_allowed_that_changes_its_inputs_changes_nothing_read_unsafely():
    """``allowed`` runs Python between pods: the lists it was given may change meanwhile (each pod's are
    read whole before its call, and checked again for the next)."""
    pods = [f"p{i}" for i in range(100)]
    held = [([(0, 3), (1, 2)], [1]) for _ in pods]
    query, out = tiered(pods, held)
    w = query.native.workers
    slots, ranks, lengths = w.slots, w.ranks, out[2]

    def allowed(pod):
        for pod_slots in slots:
            pod_slots.clear()
        for pod_ranks in ranks:
            for r in pod_ranks:
                r.clear()
        for held in lengths:
            held.clear()
        return True
    with pytest.raises(ValueError):  # the next pod's slots, read after the call: gone
        _answer_json.tiered_answer(w.pods, slots, ranks, lengths, BS, allowed)


class _Index:
    def __index__(self):
        return 0


def test_a_rank_that_is_no_int_is_refused_before_any_python_runs():
    query, out = tiered(["p"], [([(0, 3)], [])])
    w = query.native.workers
    w.ranks[0][0][0] = _Index()
    with pytest.raises(TypeError):
        _answer_json.tiered_answer(w.pods, w.slots, w.ranks, out[2], BS, None)
