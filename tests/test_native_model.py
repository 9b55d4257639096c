"""Issue 35: the native index at fleet shape, against the pure-Python reference.

- A model (hypothesis' stateful testing): worker ids up to 2,000 interned in random order (over ~32
  chunks of 64), released and reused by other pods; four tiers (GPU, CPU, STORAGE over the L1 workers,
  L3 over its own), each a ``NativeBlockIndex`` beside its ``BlockIndex``; stores of hashes shared between
  workers (KV-cache groups too), removals (by workers that never stored in the tier, of hashes nobody
  stored), clears, releases, snapshots across the two kinds, and queries: the native query on the
  product's query threads equal to ``score`` over the references. After every step both hold the same.
  A query prepared before its candidate's id was released (cleared, then given back, as the product gives
  ids back) and taken by another pod reports 0 for the first, never the other's blocks.
  The model runs in a child process: a segfault is a failure that says so (with the ops of the example
  that crashed, saved as a case of the fleet fuzz target's corpus), not a dead test run. Its seed is
  printed; ``CACHE_INDEXER_MODEL_SEED`` replays it, ``CACHE_INDEXER_MODEL_EXAMPLES`` (default 200) and
  ``CACHE_INDEXER_MODEL_STEPS`` (default 50) scale it up.
- Bugs found at fleet shape, each a plain test (those that crash, in a child process):
  1. the worker array grows by doubling past the chunks (64 ids each): a removal, ``holds`` or clear of an
     id in between read (and wrote) a chunk past the end of the chunk array;
  2. an id released with its epoch unchanged: L3 releases a pod's id when a removal leaves it nothing (no
     clear), and L1 clears a pod that only offloaded in a GPU table that has no worker of its id (nothing
     to bump): a query prepared for pod A counted the blocks of pod B, given A's id since;
  3. a store that runs out of memory part-way left the entries count off the workers' counts;
  4. (L3State) a diff that repeats a hash in its added list stored it twice (a second copy), so its
     removal left the block behind, held by a released id, which the next pod given the id inherits; a
     repeat in a removed list raised KeyError part-way through the message.
"""

from __future__ import annotations

import json
import os
import random
import textwrap
from array import array

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from cache_indexer.indexer import hit_rate
from cache_indexer.indexer.hit_rate import NativeQuery
from cache_indexer.indexer.l1_state import L1State
from cache_indexer.indexer.l3_state import L3State
from tests import native_fleet
from tests.conftest import needs_native
from tests.native_fleet import (BS, CHAINS, DOCS, HASHER, MAX_WID, PERTURB, POOL, ROOT, TIERS, Fleet, Runner, child,
                                died)

EXAMPLES = int(os.environ.get("CACHE_INDEXER_MODEL_EXAMPLES", "200"))
STEPS = int(os.environ.get("CACHE_INDEXER_MODEL_STEPS", "50"))


@pytest.fixture(autouse=True)
def _native():
    needs_native(hit_rate.NATIVE_QUERY, "the native index and query")


# -- the model -------------------------------------------------------------------------------------------
PODS = [f"10.0.0.{i}" for i in range(1, 13)]
tiers = st.sampled_from(TIERS)
pods = st.sampled_from(PODS)
ranks = st.integers(0, 2)
groups = st.sampled_from([None, None, None, None, 0, 1])


@st.composite
def hash_lists(draw) -> list[int]:
    """Runs of the documents' chains (workers share their first blocks), with holes now and then; any
    hashes of the pool (some that no chain holds); rarely, many fresh ones (segments grow)."""
    kind = draw(st.sampled_from(["run", "run", "run", "pool", "pool", "many"]))
    if kind == "run":
        chain = CHAINS[draw(st.integers(0, len(CHAINS) - 1))]
        start = draw(st.sampled_from([0, 0, 0, 3, 11, 20]))
        stop = draw(st.integers(start, len(chain)))
        hole = draw(st.sampled_from([0, 0, 0, 2, 5]))
        return [h for i, h in enumerate(chain[start:stop]) if not hole or i % hole]
    if kind == "pool":
        return draw(st.lists(st.sampled_from(POOL), max_size=10))
    rng = random.Random(draw(st.integers(0, 1 << 32)))
    return [rng.getrandbits(64) for _ in range(draw(st.sampled_from([300, 1200])))]


@st.composite
def requests(draw) -> list[int]:
    """A document cut anywhere (its prefix stored by some), maybe a token changed, maybe tokens after."""
    doc = DOCS[draw(st.integers(0, len(DOCS) - 1))]
    tokens = doc[:draw(st.integers(0, len(doc)))]
    for pos, tok in draw(st.lists(st.tuples(st.integers(0, len(doc)), st.integers(0, 150_000)), max_size=2)):
        if pos < len(tokens):
            tokens[pos] = tok
    return tokens + draw(st.lists(st.integers(0, 150_000), max_size=6))


#: the op log of the example running (a file): what a crash leaves to replay
LOG = None
RUNNER: Runner | None = None


class NativeModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.fleet: Fleet | None = None
        self.fresh = 0
        if LOG is not None:
            LOG.seek(0)
            LOG.truncate()

    @initialize(fillers=st.sampled_from([2000, 2000, 700, 64]), spread_seed=st.integers(0, (1 << 32) - 1))
    def start(self, fillers: int, spread_seed: int) -> None:
        if LOG is not None:
            LOG.write(json.dumps({"fillers": fillers, "spread_seed": spread_seed}) + "\n")
        self.fleet = Fleet(fillers, spread_seed, RUNNER, LOG)

    @rule(tier=tiers, pod=pods, rank=ranks, hashes=hash_lists(), group=groups)
    def store(self, tier, pod, rank, hashes, group):
        self.fleet.apply(["store", tier, pod, rank, hashes, group])

    @rule(tier=tiers, pod=pods, rank=ranks, hashes=hash_lists(), group=groups)
    def remove(self, tier, pod, rank, hashes, group):
        self.fleet.apply(["remove", tier, pod, rank, hashes, group])

    @rule(tier=tiers, wid=st.integers(0, MAX_WID), hashes=hash_lists())
    def remove_any_id(self, tier, wid, hashes):
        self.fleet.apply(["remove_wid", tier, wid, hashes])

    @rule(tier=tiers, wid=st.integers(0, MAX_WID), hashes=hash_lists())
    def holds_any_id(self, tier, wid, hashes):
        self.fleet.apply(["holds", tier, wid, hashes])

    @rule(tier=tiers, pod=pods, rank=ranks)
    def clear(self, tier, pod, rank):
        self.fleet.apply(["clear", tier, pod, rank])

    @rule(tier=tiers, wid=st.integers(0, MAX_WID))
    def clear_any_id(self, tier, wid):
        self.fleet.apply(["clear_wid", tier, wid])

    @rule(table=st.sampled_from(["l1", "l3"]), pod=pods, rank=ranks)
    def release(self, table, pod, rank):
        """As the product gives an id back: cleared in every tier of its table, then released (the next
        pod interned takes it)."""
        self.fleet.apply(["release", table, pod, rank])

    @rule(tier=tiers, how=st.sampled_from(["nn", "np", "pn"]))
    def snapshot(self, tier, how):
        self.fleet.apply(["reload", tier, how])

    @rule(tokens=requests(), asked=st.lists(pods, min_size=1, max_size=8, unique=True), raw=st.booleans())
    def query(self, tokens, asked, raw):
        self.fleet.apply(["query", tokens, asked + ["10.0.9.9"], raw])

    @rule(tier=tiers, pod=pods, doc=st.integers(0, len(DOCS) - 1), blocks=st.integers(1, 32),
          asked=st.lists(pods, max_size=6, unique=True))
    def query_prepared_before_a_release(self, tier, pod, doc, blocks, asked):
        self.fresh += 1
        self.fleet.apply(["stale", tier, pod, DOCS[doc][:blocks * BS], asked, f"10.0.8.{self.fresh}"])

    @invariant()
    def both_hold_the_same(self):
        if self.fleet is not None:
            self.fleet.check()


def run_model(seed_: int, examples: int, steps: int, log_path: str | None = None) -> None:
    """The model, as the child process runs it (callable in-process to debug a failure)."""
    global LOG, RUNNER
    LOG = open(log_path, "w") if log_path else None
    RUNNER = Runner()
    try:
        run_state_machine_as_test(
            seed(seed_)(NativeModel),
            settings=settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                              suppress_health_check=list(HealthCheck), print_blob=False,
                              # no explain phase: the last example run is the shrunk failure, whose ops the log keeps
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]))
    finally:
        RUNNER.close()
        if LOG is not None:
            LOG.close()


@pytest.mark.timeout(900)  # scaled up (CACHE_INDEXER_MODEL_EXAMPLES), it runs longer than the suite's 120 s
def test_the_native_index_follows_the_reference_at_fleet_shape(tmp_path):
    """The model (``NativeModel``) in a child process; a failure names the seed that replays it and, for
    a crash, saves the ops of the example that crashed (shrunk) into the fleet fuzz target's corpus."""
    seed_ = int(os.environ.get("CACHE_INDEXER_MODEL_SEED") or random.SystemRandom().randrange(1 << 32))
    print(f"CACHE_INDEXER_MODEL_SEED={seed_}")
    log = tmp_path / "ops.jsonl"
    done = child(["-c", f"from tests.test_native_model import run_model; "
                        f"run_model({seed_}, {EXAMPLES}, {STEPS}, {str(log)!r})"],
                 timeout=600, env=PERTURB)
    if done.returncode == 0:
        return
    saved = ""
    lines = log.read_text().splitlines() if log.exists() else []
    if lines and lines[0].startswith("{"):
        case = {**json.loads(lines[0]), "ops": [json.loads(line) for line in lines[1:]]}
        n = len(case["ops"])
        if done.returncode < 0:  # a crash: hypothesis could not shrink it; the ops are dropped here
            case = native_fleet.shrink("fleet", case, done.returncode, tmp_path)
        path = native_fleet.save_case("fleet", case)
        saved = (f"\nThe ops of the example that failed ({n}, the last one running; {len(case['ops'])} after "
                 f"shrinking) are saved as {path.relative_to(ROOT)} (the fleet fuzz target replays it: python -m "
                 f"tests.native_fleet replay fleet {path.relative_to(ROOT)}):\n"
                 + "\n".join(json.dumps(op)[:200] for op in case["ops"][-8:]))
    raise AssertionError(f"the model failed ({died(done)}); CACHE_INDEXER_MODEL_SEED={seed_} replays it.{saved}\n"
                         f"--- stdout ---\n{done.stdout[-6000:]}\n--- stderr ---\n{done.stderr[-4000:]}")


# -- bug 1: ids between the chunks and the worker array --------------------------------------------------
def test_a_removal_holds_or_clear_of_an_id_past_the_chunks_stays_in_bounds():
    """store(33), store(40): the worker array doubles to 68 ids, the chunks stay one (64 ids). Removing,
    asking ``holds`` of, or clearing ids 64..67 (and, at fleet shape, any id between the chunks and the
    workers) read a chunk past the end of the chunk array, and a removal of hash 0 wrote into it. In a
    child process (freed memory filled with a pattern, so that a stray read crashes): a segfault is
    reported as one."""
    done = child(["-c", textwrap.dedent("""
        from cache_indexer.indexer import _native_index

        t = _native_index.Table()
        t.store(33, [1])
        t.store(40, [1])
        t.remove(65, [0])  # the issue's reproducer
        for k in range(20000):
            wid = 64 + k % 4
            assert t.remove(wid, [0, 1, 2, 3, k + 1]) == 0
            assert t.holds(wid, [0, 1, k + 1]) == bytes(3)
            assert t.clear(wid) == 0
        assert t.as_dict() == {1: (1 << 33) | (1 << 40)}
        assert t.worker_counts() == {33: 1, 40: 1} and t.counts()[0] == 2
        # fleet shape: ids spread over 2,000, the worker array past the chunks again and again
        t = _native_index.Table()
        for wid in (3, 70, 200, 500, 1100):
            t.store(wid, [wid, 7])
            for other in range(wid + 1, min(2 * wid + 2, 2048)):
                t.remove(other, [0, 7, other])
                t.holds(other, [0, 7])
                t.clear(other)
        assert t.worker_counts() == {3: 2, 70: 2, 200: 2, 500: 2, 1100: 2}
        print("ok")
    """)], timeout=120, env=PERTURB)
    assert done.returncode == 0 and done.stdout.strip() == "ok", f"{died(done)}: {done.stderr[-3000:]}"


def test_an_offloaded_removal_by_a_worker_that_never_offloaded_stays_in_bounds():
    """Bug 1 through the product: the L1 media share the GPU's worker ids, so a CPU removal by a worker
    that never stored on the CPU (an id past the CPU table's chunks, below its worker array's end) read
    past its chunk array."""
    done = child(["-c", textwrap.dedent("""
        from cache_indexer.indexer.l1_state import L1State

        state = L1State()
        seqs = {}
        def batch(pod, events):
            seq = seqs[pod] = seqs.get(pod, -1) + 1
            state.apply({"type": "batch", "pod": pod, "rank": 0, "gen": 1, "seq": seq, "events": events})

        pods = [f"10.0.{p // 250}.{p % 250}" for p in range(2000)]
        for p, pod in enumerate(pods):  # ids 0..1999, GPU blocks
            batch(pod, [{"kind": "stored", "hashes": [p]}])
        # two workers offload: the CPU table's chunks reach id 1151, its worker array id 2201
        batch(pods[1100], [{"kind": "stored", "medium": "CPU", "hashes": [1]}])
        batch(pods[1101], [{"kind": "stored", "medium": "CPU", "hashes": [1]}])
        for k in range(30):  # CPU removals by workers that never offloaded, ids 1152..1999
            for p in range(1152, 2000):
                batch(pods[p], [{"kind": "removed", "medium": "CPU", "hashes": [0, 1, k]}])
        assert state.media["CPU"].worker_blocks == {1100: 1, 1101: 1}
        print("ok")
    """)], timeout=120, env=PERTURB)
    assert done.returncode == 0 and done.stdout.strip() == "ok", f"{died(done)}: {done.stderr[-3000:]}"


# -- bug 2: an id released without a clear ---------------------------------------------------------------
def test_a_query_prepared_before_an_l3_pods_id_went_to_another_pod_reports_0_for_it():
    """L3 releases a pod's id when a diff removes the last of its blocks (no clear: nothing is left to
    clear), and the next pod interned takes the id. A query prepared for pod A before (on the event loop),
    run after (on a query thread), must report 0 for A, not the blocks of B, which holds A's id now."""
    tokens = list(range(16 * 8))
    chain = HASHER.event_hashes(tokens, 16)
    l3 = L3State()
    l3.apply({"type": "l3_diff", "master": "m", "added": {"10.0.0.1": chain}, "removed": {}})
    wid = l3.workers.get("10.0.0.1", 0)
    query = NativeQuery.prepare(HASHER, array("Q", tokens), 16, "", ["10.0.0.1"], [None, l3])
    assert query.result(query.run()).scores[0].ratios == [0.0, 1.0]
    l3.apply({"type": "l3_diff", "master": "m", "added": {"10.0.0.2": chain}, "removed": {"10.0.0.1": chain}})
    assert l3.workers.get("10.0.0.1", 0) is None and l3.workers.get("10.0.0.2", 0) == wid, "the id was reused"
    ratios = query.result(query.run()).scores[0].ratios
    assert ratios == [0.0, 0.0], f"10.0.0.1, released, is credited with 10.0.0.2's blocks: {ratios}"


def test_a_query_prepared_before_a_pod_that_only_offloaded_left_reports_0_for_it():
    """The same through L1: a pod that stored on the CPU only is interned, its id past the GPU table's
    workers (candidates() gives it epoch 0); removing the pod clears the GPU table's worker, which does not
    exist there (nothing bumped), and releases the id; the next pod takes the id and stores on the GPU,
    its worker created with epoch 0: the query prepared for the first pod counts the second's blocks."""
    tokens = list(range(16 * 8))
    chain = HASHER.event_hashes(tokens, 16)
    l1 = L1State()
    l1.apply({"type": "batch", "pod": "10.0.0.1", "rank": 0, "gen": 1, "seq": 0,
              "events": [{"kind": "stored", "medium": "CPU", "hashes": chain}]})
    wid = l1.workers.get("10.0.0.1", 0)
    query = NativeQuery.prepare(HASHER, array("Q", tokens), 16, "", ["10.0.0.1"], [l1, None])
    l1.apply({"type": "pod_removed", "pod": "10.0.0.1"})
    l1.apply({"type": "batch", "pod": "10.0.0.2", "rank": 0, "gen": 1, "seq": 0,
              "events": [{"kind": "stored", "medium": "GPU", "hashes": chain}]})
    assert l1.workers.get("10.0.0.2", 0) == wid, "the id was reused"
    ratios = query.result(query.run()).scores[0].ratios
    assert ratios == [0.0, 0.0], f"10.0.0.1, removed, is credited with 10.0.0.2's blocks: {ratios}"


# -- bug 3: a store that fails part-way ------------------------------------------------------------------
def test_a_store_that_runs_out_of_memory_part_way_leaves_the_counts_consistent():
    """A store that fails part-way (out of memory growing a segment) keeps what it added (the call says
    so), but the table's entries count did not include it: entries() drifted from the workers' counts
    and from the table. Under an address-space limit, in a child process, stores of growing size until
    one fails; after each failure the counts agree with each other and with the table. (Not under a
    sanitizer: its allocator reserves the address space a limit would cut.)"""
    if any(s in os.environ.get("LD_PRELOAD", "") for s in ("asan", "tsan")):
        pytest.skip("an address-space limit under a sanitizer's allocator")
    done = child(["-c", textwrap.dedent("""
        import random, resource
        from cache_indexer.indexer import _native_index

        rng = random.Random(7)
        pool = rng.randbytes(8 * 4_000_000)  # the hashes, made before the limit
        t = _native_index.Table()
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        usage = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        failed = []
        resource.setrlimit(resource.RLIMIT_AS, (usage + (48 << 20), hard))  # 4 M hashes need ~150 MB
        try:  # growing stores; each time one fails, half as many: the last ones fail growing a segment
            n, at, wid = 40_000, 0, 1
            while n >= 500 and at + n <= 4_000_000:
                try:
                    t.store(wid, memoryview(pool)[8 * at:8 * (at + n)])
                    n = n * 3 // 2
                except MemoryError:
                    failed.append(wid)
                    n //= 2
                at += n
                wid = wid % 60 + 1
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        counts, entries = t.worker_counts(), t.counts()[0]
        held = {}
        for c, keys, masks in t.export_chunks():
            for m in memoryview(masks).cast("Q"):
                while m:
                    w = c * 64 + (m & -m).bit_length() - 1
                    held[w] = held.get(w, 0) + 1
                    m &= m - 1
        print("stores that failed:", failed, "entries:", entries, "the workers' counts:", counts)
        assert failed, "no store failed"
        assert held == counts, f"the workers' counts {counts} != what the table holds {held}"
        assert entries == sum(counts.values()), f"entries {entries} != the workers' {sum(counts.values())}"
        print("ok")
    """)], timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), \
        f"{died(done)}: {done.stdout[-1000:]} {done.stderr[-3000:]}"


# -- bug 4: an L3 diff that repeats a hash ---------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_an_l3_diff_that_repeats_a_hash_leaves_nothing_behind(native):
    """L3 keeps presence, not counts (the bridge counts). A hash repeated in a diff's added list was stored
    twice (the index keeps a second physical copy), its removal dropped one: the block stayed, held by a
    pod's id after the pod, holding nothing else, was released; the next pod given the id held it. A
    hash repeated in a removed list raised KeyError half-way through the message."""
    from cache_indexer.indexer.block_index import BlockIndex

    l3 = L3State()
    if not native:
        l3.index = BlockIndex()
    l3.apply({"type": "l3_diff", "master": "m", "added": {"10.0.0.1": [7, 7, 8]}, "removed": {}})
    l3.apply({"type": "l3_diff", "master": "m", "added": {}, "removed": {"10.0.0.1": [7, 8]}})
    assert l3.workers.get("10.0.0.1", 0) is None
    assert l3.index.blocks == {}, f"a released pod's id still holds {l3.index.blocks}"
    l3.apply({"type": "l3_diff", "master": "m", "added": {"10.0.0.2": [9]}, "removed": {}})
    l3.apply({"type": "l3_diff", "master": "m", "added": {"10.0.0.3": [9]}, "removed": {"10.0.0.2": [9, 9]}})
    assert l3.workers.get("10.0.0.2", 0) is None and l3.workers.get("10.0.0.3", 0) is not None
    assert l3.index.worker_blocks == {l3.workers.get("10.0.0.3", 0): 1}
