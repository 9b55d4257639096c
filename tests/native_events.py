"""Stream messages of many workers applied to the L1 and L3 states (native indexes) and to reference
states (pure-Python indexes), for the events fuzz target of tests/test_fuzz.py (corpus:
``tests/data/fuzz/events``; tests/native_fleet.py runs it in a child process).

A case: ``{"fillers": N, "spread_seed": S, "ops": [...]}`` (the worker tables spread as in native_fleet):

- ``["l1", msg]``, ``["l3", msg]``: a stream message, applied to both states;
- ``["query", tokens, raw]``: over every pod of both tiers (and one nobody knows): the native query
  (``NativeQuery`` on the query threads) equal to ``score`` over the references, and the /query walk
  (``NativeTierQuery`` where nothing is offloaded, else ``KeyWalk`` over the native tables) equal to
  ``match_keys`` over the references;
- ``["prepare", tokens]`` then, after other ops, ``["run"]``: a query prepared on the event loop and run
  on a query thread after messages were applied meanwhile, as the API does. Per candidate worker: one
  released since (its id given back, maybe to another pod) reports 0, never the next owner's blocks;
  one cleared since reports 0 or what it holds now; any other what it holds now;
- ``["check"]``: both states hold the same (indexes, media, worker ids).
"""

from __future__ import annotations

import json
import random
from array import array

from cache_indexer.indexer.block_index import BlockIndex, WorkerTable
from cache_indexer.indexer.hit_rate import NativeQuery, score
from cache_indexer.indexer.l1_state import OFFLOAD_MEDIA, L1State
from cache_indexer.indexer.l3_state import L3State
from cache_indexer.indexer.tier_match import KeyWalk, NativeTierQuery, chain_keys, match_keys
from tests.native_fleet import BS, DOCS, HASHER, _score_diff, random_hashes, random_tokens, same_index, spread

STRANGER = "10.255.255.1"


class TrackingWorkers(WorkerTable):
    """A worker table that logs the ids it gives back."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []

    def release(self, pod: str, rank: int) -> None:
        wid = self.get(pod, rank)
        super().release(pod, rank)
        if wid is not None:
            self.released.append(wid)


class TrackingIndex(BlockIndex):
    """The reference index, logging the workers it clears."""

    def __init__(self) -> None:
        super().__init__()
        self.cleared: list[int] = []

    def clear(self, wid: int) -> int:
        self.cleared.append(wid)
        return super().clear(wid)


class Events:
    def __init__(self, fillers: int, spread_seed: int, runner=None) -> None:
        self.runner = runner
        self.l1, self.l1_ref, self.l3, self.l3_ref = L1State(), L1State(), L3State(), L3State()
        for state, ref in ((self.l1, self.l1_ref), (self.l3, self.l3_ref)):
            ref.workers, ref.index = TrackingWorkers(), TrackingIndex()
            spread(state.workers, fillers, random.Random(spread_seed))
            spread(ref.workers, fillers, random.Random(spread_seed))
            ref.workers.released.clear()
        self.l1_ref.media = {m: BlockIndex() for m in OFFLOAD_MEDIA}
        self.pending = None

    def apply(self, op: list) -> None:
        getattr(self, "op_" + op[0])(*op[1:])

    def _both(self, nat, ref, msg: dict) -> None:
        """A message applied to both (each its own copy, as two replicas decode it). A refusal
        (ValueError) must be both's; any other exception is a failure."""
        errors = []
        for state in (ref, nat):
            try:
                state.apply(json.loads(json.dumps(msg)))
                errors.append(None)
            except ValueError as exc:
                errors.append(type(exc))
            except Exception as exc:  # noqa: BLE001
                raise AssertionError(f"{msg['type']} raised {exc!r} ({type(state.index).__name__})") from exc
        assert errors[0] == errors[1], f"{msg['type']}: the reference raised {errors[0]}, the native state {errors[1]}"

    def op_l1(self, msg: dict) -> None:
        self._both(self.l1, self.l1_ref, msg)

    def op_l3(self, msg: dict) -> None:
        self._both(self.l3, self.l3_ref, msg)

    def pods(self) -> list[str]:
        return sorted(set(self.l1.workers.pods()) | set(self.l3.workers.pods())) + [STRANGER]

    def op_query(self, tokens: list[int], raw: bool) -> None:
        pods = self.pods()
        arg = json.dumps(tokens).encode() if raw else array("Q", tokens)
        want = score(HASHER, tokens, BS, "", pods, [self.l1_ref, self.l3_ref])
        query = NativeQuery.prepare(HASHER, arg, BS, "", pods, [self.l1, self.l3])
        out = self.runner.run(query) if self.runner is not None else query.run()
        got = query.result(out)
        assert got == want, _score_diff(pods, want, got)
        n_blocks = len(tokens) // BS
        walk = match_keys(chain_keys(HASHER, tokens, BS, ""), n_blocks, self.l1_ref, self.l3_ref)
        tier_query = NativeTierQuery.prepare(HASHER, arg, BS, "", self.l1, self.l3)
        if tier_query is None:  # something offloaded: the Python walk, over the native tables
            native = KeyWalk(n_blocks, self.l1, self.l3)
            native.feed(chain_keys(HASHER, tokens, BS, ""))
            got_walk = native.result()
        else:
            got_walk = tier_query.result(self.runner.run(tier_query.native) if self.runner is not None
                                         else tier_query.native.run())
        assert got_walk == walk, f"/query walk: native {got_walk} != reference {walk}"

    def op_prepare(self, tokens: list[int]) -> None:
        pods = self.pods()
        query = NativeQuery.prepare(HASHER, array("Q", tokens), BS, "", pods, [self.l1, self.l3], with_ranks=True)
        candidates = [[dict(t.pod_workers(p)) for t in (self.l1, self.l3)] for p in pods]
        marks = (len(self.l1_ref.workers.released), len(self.l3_ref.workers.released), len(self.l1_ref.index.cleared))
        self.pending = (query, tokens, pods, candidates, marks)

    def op_run(self) -> None:
        if self.pending is None:
            return
        query, tokens, pods, candidates, (r1, r3, c1) = self.pending
        self.pending = None
        out = self.runner.run(query) if self.runner is not None else query.run()
        lengths = query.rank_lengths(out)
        keys = HASHER.event_hashes(tokens, BS)
        released = [set(self.l1_ref.workers.released[r1:]), set(self.l3_ref.workers.released[r3:])]
        cleared = [set(self.l1_ref.index.cleared[c1:]), set()]
        tables = [self.l1_ref.index.blocks, self.l3_ref.index.blocks]
        wrong = []
        for pod, per_tier, cands in zip(pods, lengths, candidates):
            for ti, (got, wids) in enumerate(zip(per_tier, cands)):
                for rank, wid in wids.items():
                    now = _run_length(tables[ti], keys, wid)
                    if wid in released[ti]:
                        ok, want = got[rank] == 0, "0 (released since)"
                    elif wid in cleared[ti]:
                        ok, want = got[rank] in (0, now), f"0 or {now} (cleared since)"
                    else:
                        ok, want = got[rank] == now, str(now)
                    if not ok:
                        owner = [p for (p, r), w in (self.l1 if ti == 0 else self.l3).workers.items() if w == wid]
                        wrong.append(f"{pod} rank {rank} ({['L1', 'L3'][ti]} id {wid}, now {owner or 'free'}): "
                                     f"{got[rank]} blocks, want {want}")
        assert not wrong, "a query prepared before messages were applied, run after: " + "; ".join(wrong[:6])

    def op_check(self) -> None:
        self.check()

    def check(self) -> None:
        same_index(self.l1_ref.index, self.l1.index, "L1 GPU")
        for m in OFFLOAD_MEDIA:
            same_index(self.l1_ref.media[m], self.l1.media[m], f"L1 {m}")
        same_index(self.l3_ref.index, self.l3.index, "L3")
        for state, ref, name in ((self.l1, self.l1_ref, "L1"), (self.l3, self.l3_ref, "L3")):
            assert dict(state.workers.items()) == dict(ref.workers.items()), f"{name}: worker ids differ"
            interned = {wid for _, wid in state.workers.items()}
            for medium, index in [("", state.index), *getattr(state, "media", {}).items()]:
                left = {w: n for w, n in index.worker_blocks.items() if n and w not in interned}
                assert not left, f"{name} {medium}: ids released (or never interned) still hold blocks: {left}"
        assert self.l1._offloaded == self.l1_ref._offloaded


def _run_length(blocks: dict[int, int], keys: list[int], wid: int) -> int:
    n = 0
    for key in keys:
        if not blocks.get(key, 0) >> wid & 1:
            break
        n += 1
    return n


def run_case(case: dict, runner=None) -> Events:
    events = Events(case.get("fillers", 0), case.get("spread_seed", 0), runner)
    for i, op in enumerate(case["ops"]):
        try:
            events.apply(op)
        except AssertionError as exc:
            raise AssertionError(f"op {i} {json.dumps(op)[:300]}: {exc}") from None
    events.check()
    return events


class _Maker:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        n = rng.choice([40, 150, 400])
        self.pods = [f"10.1.{i // 200}.{i % 200}" for i in range(n)]
        self.ranks = rng.choice([1, 2])
        self.masters = ["m0", "m1", "m2"][:rng.randint(1, 3)]
        self.cursors: dict[tuple[str, int], list[int]] = {}  # (pod, rank) -> [gen, next seq]

    def hashes(self) -> list[int]:
        hs = random_hashes(self.rng)
        return hs[:200]

    def event(self) -> dict:
        rng = self.rng
        medium = rng.choice([None, "GPU", "GPU", "GPU", "CPU", "STORAGE"])
        r = rng.random()
        if r < 0.6:
            ev = {"kind": "stored", "hashes": self.hashes()}
        elif r < 0.93:
            ev = {"kind": "removed", "hashes": self.hashes()}
        else:
            ev = {"kind": "cleared"}
        if medium is not None:
            ev["medium"] = medium
        if ev["kind"] != "cleared" and rng.random() < 0.15:
            ev["group_idx"] = rng.choice([0, 1])
        return ev

    def l1(self, pod: str | None = None, rank: int | None = None) -> dict:
        rng = self.rng
        if pod is None:
            pod, rank = rng.choice(self.pods), rng.randrange(self.ranks)
        cur = self.cursors.setdefault((pod, rank), [1, 0])
        r = rng.random()
        if r < 0.03:
            cur[0], cur[1] = cur[0] + 1, 0
            return {"type": "reset", "pod": pod, "rank": rank, "gen": cur[0], "next_seq": 0}
        if r < 0.06:
            for rk in range(self.ranks):  # what follows is a newer generation (the pod came back)
                c = self.cursors.setdefault((pod, rk), [1, 0])
                c[0], c[1] = c[0] + 1, 0
            return {"type": "pod_removed", "pod": pod}
        if r < 0.08 and cur[1]:
            seq = cur[1] - 1  # a duplicate
        else:
            seq = cur[1]
            cur[1] += 1
        return {"type": "batch", "pod": pod, "rank": rank, "gen": cur[0], "seq": seq,
                "events": [self.event() for _ in range(rng.randint(1, 4))]}

    def l3(self) -> dict:
        rng = self.rng
        master = rng.choice(self.masters)
        if rng.random() < 0.15:  # a full state: the pods left out are released, their ids reused at once
            pods = rng.sample(self.pods, min(len(self.pods), rng.randint(0, 12)))
            return {"type": "l3_full", "master": master, "pods": {p: self.hashes() for p in pods}}
        return {"type": "l3_diff", "master": master,
                "added": {rng.choice(self.pods): self.hashes() for _ in range(rng.randint(0, 4))},
                "removed": {rng.choice(self.pods): self.hashes() for _ in range(rng.randint(0, 3))}}

    def case(self) -> dict:
        rng = self.rng
        ops: list[list] = []
        workers = [(p, r) for p in self.pods for r in range(self.ranks)]
        rng.shuffle(workers)
        for pod, rank in workers:  # populate: every worker of L1 (interned in this random order), L3's
            ops.append(["l1", self.l1(pod, rank)])
            if rng.random() < 0.15:
                ops.append(["l3", self.l3()])
        ops.append(["check"])
        for _ in range(rng.randrange(40, 250)):
            ops.append(self.op())
        ops.append(["run"])
        return {"fillers": rng.choice([0, 300, 2000]), "spread_seed": rng.getrandbits(32), "ops": ops}


    def op(self) -> list:
        rng = self.rng
        r = rng.random()
        if r < 0.55:
            return ["l1", self.l1()]
        if r < 0.72:
            return ["l3", self.l3()]
        if r < 0.84:
            return ["query", random_tokens(rng), rng.random() < 0.5]
        if r < 0.9:
            return ["prepare", rng.choice(DOCS)[:BS * rng.randint(1, 32)]]
        if r < 0.97:
            return ["run"]
        return ["check"]


def random_case(rng: random.Random) -> dict:
    return _Maker(rng).case()


def maker(rng: random.Random) -> _Maker:
    return _Maker(rng)
