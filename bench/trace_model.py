"""The model behind ``bench trace``: a public trace's requests, the token ids each prefix-block id stands
for, and a fleet of vLLM engines whose KV caches follow vLLM's ``BlockPool`` (v1) as far as its KV events
go, plus the engines' truth that a router with perfect knowledge would see.

- **Traces.** Mooncake's format (FAST'25 release: ``timestamp`` in ms, ``hash_ids`` one id per 512-token
  block) and the ``alibaba-edu/qwen-bailian-usagetraces-anon`` layout (``chat_id``, ``parent_chat_id``,
  ``timestamp`` in seconds, ``hash_ids`` one id per 16-token block), told apart by their fields. Each id
  becomes a deterministic run of token ids of its own (shake-128 of the id), so equal ids give equal
  tokens, and the prompt is the ids' tokens cut to ``input_length``; vLLM's hash chain of the prompt
  (``schemas.block_hash``, sha256_cbor, seed "0") is what the engines publish and the index answers on.
- **An engine's GPU cache** (``BlockPool``): a fixed number of blocks; a free queue in LRU order (blocks
  never used first, then blocks in the order they were freed, a request's blocks freed tail first);
  a request's prefix hit is the longest run of its full blocks cached from block 0 (at most all but
  its last token, as vLLM's scheduler caps it); its hit blocks are pinned (touched) before its new
  blocks are taken from the front of the free queue, each taken block that held a hash evicted
  (``BlockRemoved``, one event a block, as vLLM publishes them); its new full prompt blocks are cached
  (one ``BlockStored`` with the parent hash, the token ids and, for a LoRA request, the adapter);
  a hash cached twice (a chain recomputed after a block in its middle was evicted) has two copies,
  each evicted on its own. A request holds blocks for its whole prompt and output until it finishes
  (prefill at ``prefill_tps`` tokens a second for the tokens it computes, then ``output_length`` x
  ``tpot``); a request that does not fit waits in the engine's queue (FIFO) until others finish.
  Output and partial blocks hold capacity but are not cached (their tokens never recur in a trace).
- **CPU offload tier** (optional, vLLM's OffloadingConnector with an LRU CPU backend): every block the
  GPU computes is stored to the CPU too (one copy a hash; ``medium: CPU`` events with token ids, as
  ``self_describing_kv_events`` makes them), the LRU evicted as ``BlockRemoved`` (CPU); a request
  loads, after its GPU hit, the run of its blocks the CPU holds from there (those GPU blocks are
  stored on the GPU as any other).
- **Several DP ranks** a pod: each rank is a worker with its own pool and socket; routing picks a rank.

Everything here runs in trace time (seconds from the trace's start), so the fleet's state after a
request depends on the decisions only, not on how fast the replay runs.
"""

from __future__ import annotations

import gzip
import hashlib
import heapq
import json
import zlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

from cache_indexer.simulate.vllm_engine import stored
from cache_indexer.schemas.block_hash import BlockHasher, LoRAKey

HASHER = BlockHasher("sha256_cbor", "0")
MOONCAKE_BLOCK_TOKENS = 512
BAILIAN_BLOCK_TOKENS = 16


@dataclass(slots=True)
class Request:
    index: int
    at: float  # seconds from the trace's start
    input_length: int
    output_length: int
    ids: tuple[int, ...]
    lora: int | None = None  # the adapter's index, or None


def _open(path: Path):
    return gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)


def load_trace(path: str | Path, limit: int | None = None, fmt: str = "auto") -> tuple[list[Request], int]:
    """The first ``limit`` requests of a trace (in arrival order) and the tokens each of its ids stands
    for. ``fmt``: "mooncake", "bailian" or "auto" (Bailian's rows have ``chat_id``)."""
    rows = []
    with _open(Path(path)) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit and fmt != "bailian" and "chat_id" not in rows[0]:
                    break  # Mooncake's files are in arrival order
    if not rows:
        raise ValueError(f"{path}: no requests")
    if fmt == "auto":
        fmt = "bailian" if "chat_id" in rows[0] else "mooncake"
    scale, block_tokens = (1.0, BAILIAN_BLOCK_TOKENS) if fmt == "bailian" else (1e-3, MOONCAKE_BLOCK_TOKENS)
    order = sorted(range(len(rows)), key=lambda i: (float(rows[i]["timestamp"]), i))[:limit]
    t0 = float(rows[order[0]]["timestamp"])
    out = []
    for k, i in enumerate(order):
        r = rows[i]
        ids = tuple(int(h) for h in r["hash_ids"])
        out.append(Request(k, (float(r["timestamp"]) - t0) * scale, min(int(r["input_length"]), len(ids) * block_tokens),
                           max(1, int(r["output_length"])), ids))
    return out, block_tokens


def assign_loras(requests: list[Request], share: float, adapters: int) -> None:
    """A ``share`` of the requests on LoRA adapters: chosen by the request's first two ids, so that the
    turns of a conversation (which share them) keep their adapter."""
    if share <= 0 or adapters <= 0:
        return
    for r in requests:
        h = zlib.crc32(repr(r.ids[:2]).encode())
        if (h % 10_000) < share * 10_000:
            r.lora = (h // 10_000) % adapters


def lora_key(k: int | None) -> LoRAKey | None:
    return None if k is None else LoRAKey(f"adapter-{k}", f"/adapters/adapter-{k}")


class Tokens:
    """Deterministic token ids for a trace's block ids (16-bit, from shake-128 of the id)."""

    def __init__(self, block_tokens: int, seed: str = "trace") -> None:
        self.block_tokens = block_tokens
        self.seed = seed.encode()

    def prompt(self, req: Request) -> list[int]:
        n = self.block_tokens * 2
        raw = b"".join(hashlib.shake_128(self.seed + b":%d" % h).digest(n) for h in req.ids)
        tokens = array("H")
        tokens.frombytes(raw[:req.input_length * 2])
        return tokens.tolist()


def chain(tokens: list[int], block_size: int, lora: int | None = None) -> list[int]:
    """vLLM's hash chain of the prompt's full blocks, as its events carry it."""
    return HASHER.event_hashes(tokens, block_size, lora=lora_key(lora))


@dataclass(slots=True)
class Pending:
    req: Request
    hashes: list[int]
    tokens: list
    blocks: int  # blocks it holds while it runs (prompt and output)


@dataclass(slots=True)
class Admission:
    """A request admitted by an engine: the batch it publishes and what it hit."""
    wid: int
    req: Request
    events: list[dict]
    hit_blocks: int  # GPU hit plus the run loaded from the CPU: prefill saved
    gpu_hit: int
    computed_tokens: int
    at: float  # trace time
    tokens: list
    stored_run: tuple[int, int] | None = None  # the worker's GPU run of this prompt (before, after), if it grew


class BlockPool:
    """One worker's GPU blocks, as vLLM v1's BlockPool keeps them (see the module's docstring)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.fresh = num_blocks  # never used: the front of the free queue
        self.next_id = 0
        self.free: OrderedDict[int, None] = OrderedDict()  # freed blocks, least recently freed first
        self.hash_of: dict[int, int] = {}  # block id -> hash (cached blocks)
        self.cached: dict[int, int] = {}  # hash -> the block a hit takes (the first cached of its copies)
        self.copies: dict[int, list[int]] = {}  # hash -> its further copies, in the order they were cached
        self.ref: dict[int, int] = {}  # block id -> running requests holding it

    def run(self, hashes: list[int]) -> list[int]:
        """The blocks of the longest run of ``hashes`` cached from block 0."""
        out = []
        cached = self.cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def available(self, hit_ids: list[int]) -> int:
        free = self.free
        return self.fresh + len(free) - sum(1 for b in hit_ids if b in free)

    def touch(self, ids: list[int]) -> None:
        ref, free = self.ref, self.free
        for b in ids:
            n = ref.get(b, 0)
            if n == 0:
                free.pop(b, None)
            ref[b] = n + 1

    def take(self, n: int, evicted: list[int]) -> list[int]:
        """``n`` blocks from the front of the free queue; the hashes they held go to ``evicted``."""
        fresh = min(n, self.fresh)
        out = list(range(self.next_id, self.next_id + fresh))
        self.fresh -= fresh
        self.next_id += fresh
        popitem, hash_of, cached, copies = self.free.popitem, self.hash_of, self.cached, self.copies
        for _ in range(n - fresh):
            b, _ = popitem(last=False)
            h = hash_of.pop(b, None)
            if h is not None:
                if cached[h] == b:
                    more = copies.get(h)
                    if more:
                        cached[h] = more.pop(0)
                        if not more:
                            del copies[h]
                    else:
                        del cached[h]
                else:
                    more = copies[h]
                    more.remove(b)
                    if not more:
                        del copies[h]
                evicted.append(h)
            out.append(b)
        ref = self.ref
        for b in out:
            ref[b] = 1
        return out

    def cache(self, ids: list[int], hashes: list[int]) -> None:
        hash_of, cached = self.hash_of, self.cached
        for b, h in zip(ids, hashes):
            hash_of[b] = h
            if h in cached:
                self.copies.setdefault(h, []).append(b)
            else:
                cached[h] = b

    def release(self, ids: list[int]) -> None:
        """A finished request's blocks, tail first (vLLM frees them reversed: its tail is evicted first)."""
        ref, free = self.ref, self.free
        for b in reversed(ids):
            n = ref[b] - 1
            if n:
                ref[b] = n
            else:
                del ref[b]
                free[b] = None


class CpuTier:
    """vLLM's CPU offload backend with LRU eviction: one copy a hash."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.lru: OrderedDict[int, None] = OrderedDict()

    def run(self, hashes: list[int], start: int, limit: int) -> int:
        """Where the run of ``hashes`` held here from ``start`` ends (at most ``limit``)."""
        lru = self.lru
        i = start
        while i < limit and hashes[i] in lru:
            i += 1
        return i

    def touch(self, hashes: list[int]) -> None:
        for h in hashes:
            if h in self.lru:
                self.lru.move_to_end(h)

    def store(self, hashes: list[int], evicted: list[int]) -> list[int]:
        """Stores those not held, after evicting the least recently used to make room (as vLLM's
        ``prepare_store``: nothing stored where the tier cannot make room); returns their indexes."""
        lru = self.lru
        new, seen = [], set()
        for i, h in enumerate(hashes):
            if h in lru:
                lru.move_to_end(h)
            elif h not in seen:
                seen.add(h)
                new.append(i)
        over = len(lru) + len(new) - self.num_blocks
        if over > len(lru):
            return []
        for _ in range(max(0, over)):
            old, _ = lru.popitem(last=False)
            evicted.append(old)
        for i in new:
            lru[hashes[i]] = None
        return new


@dataclass
class Worker:
    wid: int
    pod: str
    rank: int
    pool: BlockPool
    cpu: CpuTier | None = None
    running: dict[int, list[int]] = field(default_factory=dict)  # request index -> its blocks
    waiting: deque = field(default_factory=deque)  # Pending
    active_blocks: int = 0  # blocks of running and waiting requests: the router's load
    running_blocks: dict[int, int] = field(default_factory=dict)


class Fleet:
    """The engines (``pods`` x ``ranks`` workers) and their truth: hash -> the workers holding it, per medium."""

    def __init__(self, pods: list[str], ranks: int, gpu_blocks: int, block_size: int, cpu_blocks: int = 0,
                 prefill_tps: float = 10_000.0, tpot: float = 0.03) -> None:
        self.block_size = block_size
        self.prefill_tps = prefill_tps
        self.tpot = tpot
        self.workers = [Worker(i * ranks + r, pod, r, BlockPool(gpu_blocks), CpuTier(cpu_blocks) if cpu_blocks else None)
                        for i, pod in enumerate(pods) for r in range(ranks)]
        #: hash -> mask of the workers holding it (bit = worker id)
        self.gpu_holders: dict[int, int] = {}
        self.cpu_holders: dict[int, int] = {}
        #: finishing times: (trace time, seq, wid, request index)
        self.finishing: list[tuple[float, int, int, int]] = []
        self._seq = 0
        self.stored_events = self.removed_events = 0

    # -- truth -------------------------------------------------------------------------------------
    def gpu_runs(self, hashes: list[int]) -> list[int]:
        """Per worker, the run of ``hashes`` its GPU holds from block 0."""
        runs = [0] * len(self.workers)
        if not hashes:
            return runs
        get = self.gpu_holders.get
        alive = get(hashes[0], 0)
        i = 1
        for h in hashes[1:]:
            if not alive:
                return runs
            nxt = alive & get(h, 0)
            if nxt != alive:
                _set_bits(runs, alive & ~nxt, i)
                alive = nxt
            i += 1
        _set_bits(runs, alive, i)
        return runs

    def loadable_runs(self, hashes: list[int], gpu: list[int] | None = None) -> list[int]:
        """Per worker, where the GPU's run and then the CPU's from there end: what a request would not
        compute (without the CPU tier: the GPU's run)."""
        gpu = gpu if gpu is not None else self.gpu_runs(hashes)
        if not self.cpu_holders:
            return gpu
        n = len(hashes)
        out = list(gpu)
        for w in self.workers:
            if w.cpu is not None and gpu[w.wid] < n:
                out[w.wid] = w.cpu.run(hashes, gpu[w.wid], n)
        return out

    def held(self, wid: int, medium: str = "GPU") -> set[int]:
        w = self.workers[wid]
        if medium == "GPU":
            return set(w.pool.cached)
        return set(w.cpu.lru) if w.cpu is not None else set()

    def run_on(self, wid: int, hashes: list[int]) -> int:
        """The run of ``hashes`` worker ``wid``'s GPU holds from block 0."""
        return len(self.workers[wid].pool.run(hashes))

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, wid: int, req: Request, hashes: list[int], tokens: list[int], at: float) -> Admission | None:
        """The request reaches worker ``wid`` at trace time ``at``: admitted now (its batch), or queued."""
        w = self.workers[wid]
        bs = self.block_size
        blocks = -(-(req.input_length + req.output_length) // bs)
        p = Pending(req, hashes, tokens, blocks)
        w.active_blocks += blocks
        if w.waiting:
            w.waiting.append(p)
            return None
        adm = self._admit(w, p, at)
        if adm is None:
            w.waiting.append(p)
        return adm

    def next_finish(self) -> float | None:
        return self.finishing[0][0] if self.finishing else None

    def finish_next(self) -> list[Admission]:
        """The next request to finish frees its blocks; queued requests of its worker that fit now start."""
        at, _, wid, index = heapq.heappop(self.finishing)
        w = self.workers[wid]
        w.pool.release(w.running.pop(index))
        w.active_blocks -= w.running_blocks.pop(index)
        out = []
        while w.waiting:
            adm = self._admit(w, w.waiting[0], at)
            if adm is None:
                break
            w.waiting.popleft()
            out.append(adm)
        return out

    def _admit(self, w: Worker, p: Pending, at: float) -> Admission | None:
        bs = self.block_size
        req, hashes = p.req, p.hashes
        n = len(hashes)
        limit = (req.input_length - 1) // bs  # vLLM computes at least the last token
        pool = w.pool
        run = pool.run(hashes)
        hit_ids = run[:limit]
        gpu_hit = len(hit_ids)
        new = p.blocks - gpu_hit
        if new > pool.available(hit_ids):
            if new > pool.num_blocks:
                raise ValueError(f"request {req.index} needs {p.blocks} blocks, more than a worker's {pool.num_blocks}")
            return None
        loaded = w.cpu.run(hashes, gpu_hit, limit) if w.cpu is not None else gpu_hit
        pool.touch(hit_ids)
        evicted: list[int] = []
        ids = pool.take(new, evicted)
        bit = 1 << w.wid
        events = []
        if evicted:
            holders, cached = self.gpu_holders, pool.cached
            for h in evicted:
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU", "group_idx": 0})
                if h not in cached:
                    m = holders[h] & ~bit
                    if m:
                        holders[h] = m
                    else:
                        del holders[h]
            self.removed_events += len(evicted)
        new_hashes = hashes[gpu_hit:]
        pool.cache(ids[:len(new_hashes)], new_hashes)
        lora = lora_key(req.lora)
        tokens = p.tokens
        if new_hashes:
            events.append(self._stored(hashes, tokens, gpu_hit, n, "GPU", lora))
            holders = self.gpu_holders
            get = holders.get
            for h in new_hashes:
                holders[h] = get(h, 0) | bit
            self.stored_events += len(new_hashes)
        if w.cpu is not None:
            w.cpu.touch(hashes[gpu_hit:loaded])
            cpu_evicted: list[int] = []
            stored_at = w.cpu.store(hashes[loaded:n], cpu_evicted)
            holders = self.cpu_holders
            for h in cpu_evicted:
                events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": "CPU", "group_idx": 0})
                m = holders[h] & ~bit
                if m:
                    holders[h] = m
                else:
                    del holders[h]
            for a, z in _runs([loaded + i for i in stored_at]):
                events.append(self._stored(hashes, tokens, a, z, "CPU", lora))
            for i in stored_at:
                h = hashes[loaded + i]
                holders[h] = holders.get(h, 0) | bit
            self.removed_events += len(cpu_evicted)
            self.stored_events += len(stored_at)
        w.running[req.index] = hit_ids + ids
        w.running_blocks[req.index] = p.blocks
        computed = req.input_length - loaded * bs
        done = at + computed / self.prefill_tps + req.output_length * self.tpot
        self._seq += 1
        heapq.heappush(self.finishing, (done, self._seq, w.wid, req.index))
        # every full block of the prompt is cached now: the worker's run of it is the whole prompt
        before = len(run)
        return Admission(w.wid, req, events, loaded, gpu_hit, computed, at, tokens, (before, n) if n > before else None)

    def _stored(self, hashes, tokens: list[int], a: int, z: int, medium: str, lora: LoRAKey | None) -> dict:
        bs = self.block_size
        ev = stored(hashes[a:z], parent=hashes[a - 1] if a else None, medium=medium, block_size=bs,
                    token_ids=tokens[a * bs:z * bs], lora_name=lora.name if lora else None)
        ev["extra_keys"] = [[lora.name] for _ in range(z - a)] if lora else [None] * (z - a)
        return ev


def _set_bits(runs: list[int], mask: int, value: int) -> None:
    while mask:
        low = mask & -mask
        runs[low.bit_length() - 1] = value
        mask ^= low


def _runs(idx: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs [a, z) of sorted indexes."""
    out = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def cost(prompt_blocks: int, hits: list[int], load: list[int]) -> list[int]:
    """Dynamo's default cost a worker: the blocks it would prefill plus its active blocks."""
    return [prompt_blocks - h + a for h, a in zip(hits, load)]


def argmin(values: list[int]) -> int:
    best, at = values[0], 0
    for i, v in enumerate(values):
        if v < best:
            best, at = v, i
    return at
