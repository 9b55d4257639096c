"""``explain``: why a candidate's L1 ratio is what it is (``"explain": true`` in a hit-rate request).

A ratio of 0 is the complaint every index in this field hears, and it has a handful of causes, named
here in the order an operator would check them: a pod nobody subscribes to (the router names pods by
an address discovery does not list), a pod subscribed that never published, engines that hash blocks
differently from ``blockKey`` (the bridge's last check of the engine's own hash, recorded per pod, and
the request's first block found on the pod under another usual setting), and a prefix that stops at
block k. A diagnostic call: it reads the bridge's records and hashes the first block a few more times.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from cache_indexer.api.hit_rate_request import HitRateQuery
from cache_indexer.indexer.hit_rate import ScoreResult, Tier
from cache_indexer.infra.block_key_verdicts import read_verdict
from cache_indexer.infra.streams import RecordsKv
from cache_indexer.infra.targets_record import read_endpoints
from cache_indexer.schemas.block_hash import HASH_ALGOS, BlockHasher

#: The settings engines usually run with: PYTHONHASHSEED 0 (the documented deployment's) or unset
_USUAL_SEEDS = ("0", None)


class Explainer:
    def __init__(self, hasher: BlockHasher, records: Callable[[], RecordsKv | None]) -> None:
        self.records = records
        self._others: list[tuple[dict, BlockHasher]] = []
        for algo in HASH_ALGOS:
            for seed in _USUAL_SEEDS:
                if seed is None and algo.startswith("xxhash"):
                    continue  # vLLM seeds xxhash's NONE_HASH randomly without a seed: nobody can follow it
                for encoding in ("tagged", "untagged"):
                    other = BlockHasher(algo, seed, encoding)
                    if (other.algo, other.none_hash, other.extra_keys_encoding) != \
                            (hasher.algo, hasher.none_hash, hasher.extra_keys_encoding):
                        self._others.append(({"hashAlgo": algo, "pythonHashSeed": seed,
                                              "extraKeysEncoding": encoding}, other))

    async def explain(self, req: HitRateQuery, result: ScoreResult, l1: Tier | None) -> list[dict]:
        records = self.records()
        subscribed: set[str] | None = None
        if records is not None:
            try:
                endpoints = await read_endpoints(records)
                subscribed = {row[0] for row in endpoints or ()}
            except Exception:
                subscribed = None
        tokens = req.tokens()
        bs, n = req.block_size, result.full_blocks
        now = time.time_ns()
        out = []
        # per request, not per candidate: a pod named 64 times with a 1.9M-token first block held the loop 20 s
        first_keys: list[tuple[dict, int]] | None = None
        verdicts: dict = {}
        for score in result.scores:
            pod = score.pod
            ranks = l1.pod_workers(pod) if l1 is not None else {}
            activity = getattr(l1, "activity", {}).get(pod)
            if pod not in verdicts:
                verdicts[pod] = await read_verdict(records, pod) if records is not None else None
            verdict = verdicts[pod]
            held = round(score.ratios[0] * n)
            elsewhere = []
            if n and not held and ranks:
                if first_keys is None:
                    first_keys = self._first_block_keys(req, tokens)
                elsewhere = _held_under(first_keys, l1, ranks)
            item = {
                "known": score.known, "subscribed": None if subscribed is None else pod in subscribed,
                "ranks": sorted(ranks), "first_seen_s_ago": _ago(now, activity[0]) if activity else None,
                "last_event_s_ago": _ago(now, activity[1]) if activity else None, "request_blocks": n,
                "l1_blocks": held, "first_missing_block": held if held < n else None,
                "block_key_ok": verdict.ok if verdict else None, "block_key_advice": verdict.advice if verdict else "",
                "first_block_matches_under": elsewhere,
            }
            item["cause"] = _cause(pod, item, bs, verdict.advice if verdict else "")
            out.append(item)
        return out

    def _first_block_keys(self, req: HitRateQuery, tokens) -> list[tuple[dict, int]]:
        """The request's first block under each other usual setting."""
        bs = req.block_size
        keys = []
        for setting, hasher in self._others:
            try:
                keys.append((setting, hasher.event_hashes(tokens[:bs], bs, cache_salt=req.cache_salt or None,
                                                          lora=req.lora, mm_features=req.mm_features)[0]))
            except (ValueError, TypeError, OverflowError):
                continue  # a token this encoding cannot take
        return keys


def _held_under(keys: list[tuple[dict, int]], l1, ranks: dict[int, int]) -> list[dict]:
    """The settings among ``keys`` under which the first block is on the pod (any rank)."""
    mask = 0
    for wid in ranks.values():
        mask |= 1 << wid
    return [setting for setting, key in keys if l1.index.masks.get(key, 0) & mask]


def _ago(now: int, then: int) -> float | None:
    return round((now - then) / 1e9, 3) if then else None


def _cause(pod: str, item: dict, block_size: int, advice: str) -> str:
    if not item["known"]:
        if item["subscribed"] is False:
            return (f"unknown pod: no bridge subscribes to {pod} and no events of it were indexed; the router must "
                    "name pods by the address discovery lists (the pod IP), or the engine must be registered")
        return (f"no events from {pod}: it is subscribed but has published nothing; check the engine's "
                "--kv-events-config (enable_kv_cache_events true, publisher zmq, the endpoint's port)")
    if item["block_key_ok"] is False or item["first_block_matches_under"]:
        hint = advice or "the request's first block is on the pod under " + ", ".join(
            f"hashAlgo={s['hashAlgo']} pythonHashSeed={s['pythonHashSeed']!r} extraKeysEncoding="
            f"{s['extraKeysEncoding']}" for s in item["first_block_matches_under"])
        return f"blockKey mismatch: the engine hashes blocks differently from blockKey. {hint}"
    n, held = item["request_blocks"], item["l1_blocks"]
    if not n:
        return f"no full block: the request has fewer than block_size ({block_size}) tokens"
    if held < n:
        return (f"prefix stops at block {held}: block {held} (tokens {held * block_size}..{(held + 1) * block_size - 1}) "
                "is not in the pod's GPU cache")
    return "the whole prefix is cached"
