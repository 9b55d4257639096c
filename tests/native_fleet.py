"""The native index at fleet shape (issue 35), shared by tests/test_native_model.py, tests/test_fuzz.py and
tests/test_query_threads.py: worker ids spread over ~32 chunks of 64 in random order and reused, four
tiers (GPU, CPU, STORAGE over the L1 workers; L3 over its own), each a ``NativeBlockIndex`` beside its
pure-Python ``BlockIndex`` reference, driven by operations that are plain JSON lists, so that a case found
by hypothesis or by a fuzz target is written to ``tests/data/fuzz/`` and replayed from there.

A case: ``{"fillers": N, "spread_seed": S, "ops": [[kind, ...], ...]}``. ``fillers``/``spread_seed``: the
worker tables first intern N placeholder workers and release them in a random order, so the workers the
case interns get ids spread over 0..N-1 (and an id released goes back on top: the next one interned
takes it). The ops (``Fleet.apply``):

- ``["store", tier, pod, rank, hashes, group]``, ``["remove", tier, pod, rank, hashes, group]``: through the
  worker's id (interned on store; a removal by a worker that is not interned does nothing, as the
  product does; one interned in the table but that never stored in this tier is the interesting case);
- ``["store_wid", tier, wid, hashes]``, ``["remove_wid", tier, wid, hashes]``, ``["clear_wid", tier, wid]``,
  ``["holds", tier, wid, hashes]``: straight on the indexes, any id below 2**16;
- ``["clear", tier, pod, rank]``; ``["release", "l1" | "l3", pod, rank]``: as the product releases an id
  (every tier of its table cleared, then the id released);
- ``["reload", tier, "nn" | "np" | "pn"]``: a snapshot round trip (export_chunks -> restore_chunks):
  native -> native, native -> Python, Python -> native;
- ``["query", tokens, pods, raw]``: the native query on the query threads (``QueryThreads``) and on the
  calling thread, equal to ``hit_rate.score`` over the references;
- ``["stale", tier, pod, tokens, pods, new_pod]``: a query prepared while ``pod`` holds the request's
  chain in ``tier``, then ``pod`` released (clear, release) and its id taken by ``new_pod``, which stores
  the same chain: the prepared query, run then, reports 0 for ``pod`` (never ``new_pod``'s blocks);
- ``["check"]``: the invariants (``Fleet.check``).

Run as a module, it is the child process of the fuzz targets (``python -m tests.native_fleet fuzz ...``):
a case that kills the process (a segfault) is still saved, by the parent, from the file the child writes
each case to before running it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import traceback
from array import array
from pathlib import Path

from cache_indexer.indexer.block_index import BlockIndex, NativeBlockIndex, WorkerTable
from cache_indexer.indexer.hit_rate import NativeQuery, score
from cache_indexer.schemas.block_hash import BlockHasher

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "tests" / "data" / "fuzz"
HASHER = BlockHasher("sha256_cbor", "0")
BS = 4
TIERS = ("GPU", "CPU", "STORAGE", "L3")
TABLE_OF = {"GPU": "l1", "CPU": "l1", "STORAGE": "l1", "L3": "l3"}
TABLE_TIERS = {"l1": TIERS[:3], "l3": TIERS[3:]}
MAX_WID = 2047  # raw ops: ids up to here (fillers go to 2,000)


def _documents(n_docs: int = 12, blocks: int = 32, seed: int = 35) -> list[list[int]]:
    """Token sequences that share prefixes as conversations do: each document goes on from a prefix of an
    earlier one (a tree), so workers holding different documents share the first blocks."""
    rng = random.Random(seed)
    docs = [[rng.randrange(150_000) for _ in range(blocks * BS)]]
    for _ in range(1, n_docs):
        parent = rng.choice(docs)
        keep = rng.randrange(0, blocks) * BS
        docs.append(parent[:keep] + [rng.randrange(150_000) for _ in range(blocks * BS - keep)])
    return docs


DOCS = _documents()
CHAINS = [HASHER.event_hashes(d, BS) for d in DOCS]
#: every hash of the documents' chains, and edge values and strangers no chain holds
POOL = sorted({h for c in CHAINS for h in c} | {0, 1, 2, (1 << 63) + 7, (1 << 64) - 1, 0x0123456789ABCDEF})


def spread(table: WorkerTable, fillers: int, rng: random.Random) -> None:
    """Intern ``fillers`` placeholder workers and release them in a random order: the workers interned
    next get ids spread over 0..fillers-1 (a chunk of 64 ids here, another there)."""
    names = [(f"filler-{i}", 0) for i in range(fillers)]
    for pod, rank in names:
        table.intern(pod, rank)
    rng.shuffle(names)
    for pod, rank in names:
        table.release(pod, rank)


class FleetTier:
    """What ``score`` and ``NativeQuery`` read of a tier: its index and its pods' workers."""

    def __init__(self, workers: WorkerTable, index: BlockIndex) -> None:
        self.workers, self.index = workers, index

    def pod_workers(self, pod: str) -> dict[int, int]:
        return self.workers.pod_workers(pod)

    def knows(self, pod: str) -> bool:
        return bool(self.workers.pod_workers(pod))


class Runner:
    """The product's query threads (``QueryThreads`` over ``_native_index.QueryPool``) on an event loop of
    its own, for callers without one."""

    def __init__(self, threads: int = 2) -> None:
        from cache_indexer.indexer.query_threads import QueryThreads

        self.loop = asyncio.new_event_loop()
        self.threads = QueryThreads(threads)

    def run(self, query: NativeQuery):
        return self.loop.run_until_complete(self.threads.run(query))

    def close(self) -> None:
        self.threads.close()
        self.loop.close()


def same_index(ref: BlockIndex, nat: BlockIndex, what: str = "") -> None:
    """``nat`` holds what ``ref`` holds: masks, per-worker counts, entries, side maps."""
    blocks = nat.blocks
    assert blocks == ref.blocks, f"{what}: blocks differ: {_dict_diff(ref.blocks, blocks)}"
    counts = nat.worker_blocks
    assert counts == {w: n for w, n in ref.worker_blocks.items() if n}, \
        f"{what}: worker_blocks differ: {_dict_diff({w: n for w, n in ref.worker_blocks.items() if n}, counts)}"
    assert nat.entries() == ref.entries() == sum(counts.values()), \
        f"{what}: entries {nat.entries()} (native) {ref.entries()} (reference) {sum(counts.values())} (summed)"
    assert nat.groups == ref.groups, f"{what}: groups differ"
    assert nat.copies == ref.copies, f"{what}: copies differ"
    assert len(nat) == len(ref), f"{what}: distinct hashes {len(nat)} != {len(ref)}"


def _dict_diff(want: dict, got: dict, n: int = 4) -> str:
    keys = sorted(set(want) ^ set(got) | {k for k in set(want) & set(got) if want[k] != got[k]})
    return ", ".join(f"{k}: want {want.get(k)!r} got {got.get(k)!r}" for k in keys[:n]) + \
        (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def _tokens_arg(tokens: list[int], raw: bool):
    return json.dumps(tokens).encode() if raw else array("Q", tokens)


class Fleet:
    """Four tiers, each a native index and its reference, over two worker tables (L1's, L3's)."""

    def __init__(self, fillers: int = 2000, spread_seed: int = 0, runner: Runner | None = None,
                 log=None) -> None:
        rng = random.Random(spread_seed)
        self.fillers, self.spread_seed = fillers, spread_seed
        self.workers = {"l1": WorkerTable(), "l3": WorkerTable()}
        for table in self.workers.values():
            spread(table, fillers, rng)
        self.native: dict[str, BlockIndex] = {t: NativeBlockIndex() for t in TIERS}
        self.ref: dict[str, BlockIndex] = {t: BlockIndex() for t in TIERS}
        self.runner = runner
        self.log = log  # a writable text file: each op as a JSON line, before it runs
        self.queries = 0

    def tiers(self, native: bool) -> list[FleetTier]:
        indexes = self.native if native else self.ref
        return [FleetTier(self.workers[TABLE_OF[t]], indexes[t]) for t in TIERS]

    # -- operations ------------------------------------------------------------------------------------
    def apply(self, op: list) -> None:
        if self.log is not None:
            self.log.write(json.dumps(op) + "\n")
            self.log.flush()
        getattr(self, "op_" + op[0])(*op[1:])

    def _both(self, tier: str, method: str, *args) -> list:
        """The reference's answer, then the native index's."""
        return [getattr(index[tier], method)(*args) for index in (self.ref, self.native)]

    def op_store(self, tier: str, pod: str, rank: int, hashes: list[int], group: int | None) -> None:
        wid = self.workers[TABLE_OF[tier]].intern(pod, rank)
        self._both(tier, "store", wid, hashes, group)

    def op_remove(self, tier: str, pod: str, rank: int, hashes: list[int], group: int | None) -> None:
        wid = self.workers[TABLE_OF[tier]].get(pod, rank)
        if wid is not None:
            self._both(tier, "remove", wid, hashes, group)

    def op_store_wid(self, tier: str, wid: int, hashes: list[int]) -> None:
        self._both(tier, "store", wid, hashes, None)

    def op_remove_wid(self, tier: str, wid: int, hashes: list[int]) -> None:
        self._both(tier, "remove", wid, hashes, None)

    def op_clear_wid(self, tier: str, wid: int) -> None:
        ref, nat = self._both(tier, "clear", wid)
        assert nat == ref, f"clear({wid}) in {tier}: native says {nat} blocks, the reference {ref}"

    def op_holds(self, tier: str, wid: int, hashes: list[int]) -> None:
        got = list(self.native[tier].table.holds(wid, hashes))
        bit = 1 << wid
        want = [int(bool(self.ref[tier].blocks.get(h, 0) & bit)) for h in hashes]
        assert got == want, f"holds({wid}, ...) in {tier}: {got} != {want}"

    def op_clear(self, tier: str, pod: str, rank: int) -> None:
        wid = self.workers[TABLE_OF[tier]].get(pod, rank)
        if wid is not None:
            self.op_clear_wid(tier, wid)

    def op_release(self, table: str, pod: str, rank: int) -> None:
        """As the product gives an id back: every tier of its table cleared, then the id released."""
        wid = self.workers[table].get(pod, rank)
        if wid is None:
            return
        for tier in TABLE_TIERS[table]:
            self.op_clear_wid(tier, wid)
        self.workers[table].release(pod, rank)

    def op_reload(self, tier: str, how: str) -> None:
        src = self.native[tier] if how[0] == "n" else self.ref[tier]
        into = NativeBlockIndex() if how[1] == "n" else BlockIndex()
        into.restore_chunks(src.export_chunks(), src.worker_blocks, src.groups, src.copies)
        if how == "np":
            same_index(into, self.native[tier], f"{tier} native -> Python snapshot")
            self.ref[tier] = into
        else:
            same_index(self.ref[tier], into, f"{tier} {how} snapshot")
            self.native[tier] = into

    def op_query(self, tokens: list[int], pods: list[str], raw: bool) -> None:
        self.queries += 1
        want = score(HASHER, tokens, BS, "", pods, self.tiers(native=False))
        query = NativeQuery.prepare(HASHER, _tokens_arg(tokens, raw), BS, "", pods, self.tiers(native=True))
        assert query is not None
        here = query.run()
        if self.runner is not None:
            threaded = self.runner.run(query)
            assert threaded == here, f"query threads {threaded} != calling thread {here}"
        got = query.result(here)
        assert got == want, _score_diff(pods, want, got)

    def op_stale(self, tier: str, pod: str, tokens: list[int], pods: list[str], new_pod: str) -> None:
        table = TABLE_OF[tier]
        workers = self.workers[table]
        assert workers.get(new_pod, 0) is None, f"{new_pod} is not interned in {table}"
        chain = HASHER.event_hashes(tokens, BS)
        self.op_store(tier, pod, 0, chain, None)
        pods = [pod] + [p for p in pods if p not in (pod, new_pod)]
        query = NativeQuery.prepare(HASHER, array("Q", tokens), BS, "", pods, self.tiers(native=True))
        ids = dict(workers.pod_workers(pod))
        for rank in list(ids):
            self.op_release(table, pod, rank)
        self.op_store(tier, new_pod, 0, chain, None)
        assert workers.get(new_pod, 0) in ids.values(), "the released id went to the new pod"
        out = self.runner.run(query) if self.runner is not None else query.run()
        got = query.result(out)
        mine = [r for t, r in zip(TIERS, got.scores[0].ratios) if TABLE_OF[t] == table]
        assert mine == [0.0] * len(mine), (
            f"a query prepared for {pod} (ids {ids} in {table}) before it was released and id "
            f"{workers.get(new_pod, 0)} went to {new_pod} answers {got.scores[0].ratios} (tiers {TIERS}) "
            f"for {pod}: {new_pod}'s blocks")
        want = score(HASHER, tokens, BS, "", pods, self.tiers(native=False))
        assert [s.ratios for s in got.scores] == [s.ratios for s in want.scores], _score_diff(pods, want, got)

    def op_check(self) -> None:
        self.check()

    # -- invariants ------------------------------------------------------------------------------------
    def check(self) -> None:
        for tier in TIERS:
            nat, ref = self.native[tier], self.ref[tier]
            same_index(ref, nat, tier)
            table, blocks = nat.table, ref.blocks
            for h in list(blocks)[:64] + [3, (1 << 64) - 2]:  # the dict-like lookup of the Python walk
                assert table.get(h, 0) == blocks.get(h, 0), f"{tier}: get({h})"


def _score_diff(pods, want, got) -> str:
    rows = [f"{p}: want {w.ratios} got {g.ratios}" for p, w, g in zip(pods, want.scores, got.scores)
            if w.ratios != g.ratios or w.known != g.known]
    return (f"native {got.full_blocks}/{got.hashed_blocks} blocks, reference {want.full_blocks}/"
            f"{want.hashed_blocks}; " + "; ".join(rows[:6]))


def run_case(case: dict, runner: Runner | None = None, check_every: int = 0, log=None) -> Fleet:
    """Replays a case (a corpus file's content): its ops in order, the invariants checked every
    ``check_every`` ops (0: at ``check`` ops only) and at the end."""
    fleet = Fleet(case.get("fillers", 2000), case.get("spread_seed", 0), runner, log)
    for i, op in enumerate(case["ops"]):
        try:
            fleet.apply(op)
            if check_every and i % check_every == check_every - 1:
                fleet.check()
        except AssertionError as exc:
            raise AssertionError(f"op {i} {json.dumps(op)[:300]}: {exc}") from None
    fleet.check()
    return fleet


# -- random cases ----------------------------------------------------------------------------------------
def random_tokens(rng: random.Random) -> list[int]:
    """A request whose prefix partly matches the documents: a document cut anywhere, maybe with a token
    changed here and there, maybe with tokens of its own after the cut."""
    doc = rng.choice(DOCS)
    tokens = doc[:rng.randrange(len(doc) + 1)]
    for _ in range(rng.choice([0, 0, 0, 1, 2])):
        if tokens:
            tokens[rng.randrange(len(tokens))] = rng.randrange(150_000)
    if rng.random() < 0.3:
        tokens += [rng.randrange(150_000) for _ in range(rng.randrange(1, 4 * BS))]
    return tokens


def random_hashes(rng: random.Random) -> list[int]:
    r = rng.random()
    if r < 0.6:  # a run of a chain, from its first block mostly, maybe with holes
        chain = rng.choice(CHAINS)
        start = 0 if rng.random() < 0.7 else rng.randrange(len(chain))
        run = chain[start:rng.randint(start, len(chain))]
        if rng.random() < 0.2:
            run = [h for h in run if rng.random() < 0.8]
        return run
    if r < 0.95:
        return [rng.choice(POOL) for _ in range(rng.randrange(12))]
    return [rng.getrandbits(64) for _ in range(rng.randrange(100, 1500))]  # many: segments grow


class CaseMaker:
    """Random fleet cases: a populated fleet (hundreds of workers holding chain runs over every tier),
    then removals, clears, releases, snapshots and raw ops interleaved with queries."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.pods = [f"10.0.{i // 200}.{i % 200}" for i in range(rng.choice([40, 150, 400]))]
        self.fresh = 0

    def pod(self) -> tuple[str, int]:
        return self.rng.choice(self.pods), self.rng.choice([0, 0, 0, 1, 2])

    def new_pod(self) -> str:
        self.fresh += 1
        return f"10.9.{self.fresh // 200}.{self.fresh % 200}"

    def case(self) -> dict:
        rng = self.rng
        ops: list[list] = []
        for _ in range(rng.randrange(len(self.pods) // 2, len(self.pods) * 2)):  # populate
            pod, rank = self.pod()
            ops.append(["store", rng.choice(TIERS), pod, rank, random_hashes(rng), rng.choice([None] * 6 + [0, 1])])
        ops.append(["check"])
        for _ in range(rng.randrange(20, 120)):
            ops.append(self.op())
        return {"fillers": rng.choice([200, 1000, 2000]), "spread_seed": rng.getrandbits(32), "ops": ops}

    def op(self) -> list:
        rng = self.rng
        r = rng.random()
        tier = rng.choice(TIERS)
        pod, rank = self.pod()
        if r < 0.2:
            return ["store", tier, pod, rank, random_hashes(rng), rng.choice([None] * 6 + [0, 1])]
        if r < 0.4:
            return ["remove", tier, pod, rank, random_hashes(rng), rng.choice([None] * 6 + [0, 1])]
        if r < 0.45:
            return ["clear", tier, pod, rank]
        if r < 0.5:
            return ["release", rng.choice(["l1", "l3"]), pod, rank]
        if r < 0.55:
            return ["reload", tier, rng.choice(["nn", "np", "pn"])]
        if r < 0.62:
            wid = rng.randrange(MAX_WID + 1)
            return rng.choice([["remove_wid", tier, wid, random_hashes(rng)], ["clear_wid", tier, wid],
                               ["holds", tier, wid, random_hashes(rng)], ["store_wid", tier, wid, random_hashes(rng)]])
        pods = list(dict.fromkeys(rng.choice(self.pods) for _ in range(rng.randrange(1, 24))))
        if r < 0.66:
            tokens = rng.choice(DOCS)[:BS * rng.randint(1, 32)]
            return ["stale", tier, pod, tokens, pods, self.new_pod()]
        if r < 0.7:
            return ["check"]
        return ["query", random_tokens(rng), pods, rng.random() < 0.5]


# -- fuzzing in a child process ---------------------------------------------------------------------------
def corpus(name: str) -> list[tuple[Path, dict]]:
    return [(p, json.loads(p.read_text())) for p in sorted((FUZZ / name).glob("*.json"))]


def save_case(name: str, case: dict) -> Path:
    """A failing case into the corpus (named by its content: found twice, saved once)."""
    text = json.dumps(case, indent=None, separators=(",", ":")) + "\n"
    path = FUZZ / name / f"crash-{hashlib.sha1(text.encode()).hexdigest()[:12]}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(text)
    return path


def _write_current(path: Path, case: dict, source: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"source": source, "case": case}))
    os.replace(tmp, path)


def mutated(rng: random.Random, case: dict, maker) -> dict:
    """A corpus case with random ops put in anywhere (and some of its own dropped)."""
    ops = [op for op in case["ops"] if rng.random() > 0.1]
    for _ in range(rng.randint(1, max(2, len(ops) // 4))):
        ops.insert(rng.randrange(len(ops) + 1), maker.op())
    return {**case, "ops": ops}


def fuzz_child(target: str, seed: int, seconds: float, current: Path) -> None:
    """The loop the fuzz targets run in a child: the corpus first, then random cases and mutations of
    the corpus' until ``seconds`` have passed (at least a few); each case written to ``current`` before
    it runs."""
    from tests import native_events

    run, make, maker = {"fleet": (_run_fleet_case, lambda rng: CaseMaker(rng).case(), CaseMaker),
                        "events": (native_events.run_case, native_events.random_case, native_events.maker)}[target]
    runner = Runner()
    rng = random.Random(seed)
    cases = corpus(target)
    n = 0
    try:
        for path, case in cases:
            _write_current(current, case, str(path.relative_to(ROOT)))
            run(case, runner)
            n += 1
        end = time.monotonic() + seconds
        while time.monotonic() < end or n < len(cases) + 4:
            case = mutated(rng, rng.choice(cases)[1], maker(rng)) if cases and rng.random() < 0.3 else make(rng)
            _write_current(current, case, "")
            run(case, runner)
            n += 1
    finally:
        runner.close()
    print(f"{n} cases ({len(cases)} of the corpus)")


def _run_fleet_case(case: dict, runner: Runner) -> None:
    run_case(case, runner, check_every=40)


#: glibc fills freed and new memory with a pattern: a read past an array then follows a wild pointer (a
#: segfault) where it would have found zeros and passed (no effect under AddressSanitizer, which sees it)
PERTURB = {"MALLOC_PERTURB_": os.environ.get("MALLOC_PERTURB_", "165")}


def child(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-X", "faulthandler", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def died(done: subprocess.CompletedProcess) -> str:
    """How a child ended, in words: its signal or exit status."""
    if done.returncode < 0:
        try:
            return f"killed by {signal.Signals(-done.returncode).name}"
        except ValueError:
            return f"killed by signal {-done.returncode}"
    return f"exit status {done.returncode}"


def fuzz_in_child(target: str, seed: int, seconds: float, tmp_path: Path) -> None:
    """A fuzz target's run in a child process: the corpus of ``tests/data/fuzz/<target>`` replayed, then
    random cases from ``seed``. A case that fails, or kills the child, is shrunk (ops dropped while it
    still fails the same way, for ``FUZZ_SHRINK_SECONDS``), saved into the corpus (unless it came from
    there) and the test fails saying how, with the seed that replays the run."""
    current = tmp_path / "current.json"
    done = child(["-m", "tests.native_fleet", "fuzz", target, str(seed), str(seconds), str(current)],
                 timeout=120 + 4 * seconds, env=PERTURB)
    if done.returncode == 0:
        print(done.stdout.strip())
        return
    where = "no case started"
    if current.exists():
        last = json.loads(current.read_text())
        if last["source"]:
            where = f"the corpus case {last['source']}"
        else:
            case = shrink(target, last["case"], done.returncode, tmp_path)
            where = (f"a new case ({len(last['case']['ops'])} ops, shrunk to {len(case['ops'])}), saved as "
                     f"{save_case(target, case).relative_to(ROOT)}")
    raise AssertionError(f"the {target} fuzz target failed ({died(done)}) on {where}; FUZZ_SEED={seed} replays "
                         f"the run.\n--- stdout ---\n{done.stdout[-3000:]}\n--- stderr ---\n{done.stderr[-6000:]}")


def replay_in_child(target: str, case: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "replay.json"
    path.write_text(json.dumps(case))
    return child(["-m", "tests.native_fleet", "replay", target, str(path)], timeout=120, env=PERTURB)


def shrink(target: str, case: dict, returncode: int, tmp_path: Path, seconds: float | None = None) -> dict:
    """The case with as many ops dropped as still fail the same way (the same exit status or signal, each
    try a child process), within ``seconds`` (``FUZZ_SHRINK_SECONDS``, 30 by default): chunks of the ops
    dropped, halving the chunk when none can go."""
    end = time.monotonic() + (float(os.environ.get("FUZZ_SHRINK_SECONDS", "30")) if seconds is None else seconds)
    ops, size = list(case["ops"]), max(1, len(case["ops"]) // 2)
    while ops and time.monotonic() < end:
        start, dropped = 0, False
        while start < len(ops) and time.monotonic() < end:
            trial = ops[:start] + ops[start + size:]
            if replay_in_child(target, {**case, "ops": trial}, tmp_path).returncode == returncode:
                ops, dropped = trial, True
            else:
                start += size
        if not dropped:
            if size == 1:
                break
            size = max(1, size // 2)
    return {**case, "ops": ops}


def replay(target: str, path: Path) -> None:
    """One case (a corpus file), as the fuzz target runs it: ``python -m tests.native_fleet replay fleet
    tests/data/fuzz/fleet/<case>.json``."""
    from tests import native_events

    case = json.loads(path.read_text())
    runner = Runner()
    try:
        (_run_fleet_case if target == "fleet" else native_events.run_case)(case, runner)
    finally:
        runner.close()
    print("ok")


if __name__ == "__main__":
    try:
        if sys.argv[1] == "fuzz":
            fuzz_child(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5]))
        else:
            replay(sys.argv[2], Path(sys.argv[3]))
    except AssertionError:
        traceback.print_exc()
        sys.exit(1)
