"""Checks the configured ``blockKey`` against the hashes the engines actually compute.

A ``blockKey`` that differs from the engines' settings (hash algorithm, PYTHONHASHSEED) makes every
hit ratio 0 without any error anywhere: the worst failure this product can have. Events carry what is
needed to notice: a GPU ``BlockStored`` with no parent and no extra keys holds the tokens of a first
block and the engine's hash of them (bridge.vllm_events.HashProbe). The bridge recomputes that hash
for each pod now and then (one digest per pod per ``interval``), counts the outcome and, on a
mismatch, logs an error that names the setting the engine's hash does match, where a common one does.

Hybrid models hash at the GCD of their groups' block sizes and report a larger group block by its
last constituent hash, so a probe also matches when the last hash of the chain at a divisor of the
block size equals the engine's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from cache_indexer.bridge.vllm_events import HashProbe
from cache_indexer.infra.metrics import Metrics
from cache_indexer.schemas.block_hash import HASH_ALGOS, BlockHasher

log = logging.getLogger(__name__)


class BlockKeyCheck:
    def __init__(self, block_key, metrics: Metrics, interval: float = 30.0,
                 on_verdict: Callable[[str, bool, str], None] | None = None) -> None:
        """``on_verdict(pod, ok, advice)``: called when a pod's verdict is first known or changes (the
        bridge records it for ``explain``)."""
        self.on_verdict = on_verdict
        self._verdicts: dict[str, bool] = {}
        self.block_key = block_key
        self.hasher = BlockHasher.for_block_key(block_key)
        self.metrics = metrics
        self.interval = interval
        self._due: dict[str, float] = {}  # pod -> next time its probe is checked
        self.mismatched: set[str] = set()  # pods whose last probe did not match

    def due(self, pod: str) -> bool:
        """Whether the next probe of this pod would be checked (decoders look for one only then)."""
        return time.monotonic() >= self._due.get(pod, 0.0)

    def offer(self, pod: str, probe: HashProbe) -> bool | None:
        """Check the probe if this pod is due; the result (None when not checked)."""
        now = time.monotonic()
        if now < self._due.get(pod, 0.0):
            return None
        self._due[pod] = now + self.interval
        ok = matches(self.hasher, probe)
        self.metrics.block_key_checks.labels("match" if ok else "mismatch").inc()
        advice = ""
        if ok:
            self.mismatched.discard(pod)
        else:
            if pod not in self.mismatched:
                advice = diagnose(probe, self.block_key.pythonHashSeed)
                log.error("pod %s hashes blocks differently from blockKey (hashAlgo=%s, pythonHashSeed=%r): every "
                          "hit ratio for it will be 0. %s", pod, self.block_key.hashAlgo,
                          self.block_key.pythonHashSeed, advice, extra={"pod": pod})
            self.mismatched.add(pod)
        self.metrics.block_key_mismatched_pods.set(len(self.mismatched))
        if self._verdicts.get(pod) != ok:
            self._verdicts[pod] = ok
            if self.on_verdict is not None:
                self.on_verdict(pod, ok, advice)  # a new mismatch is a new entry in ``mismatched``: advised above
        return ok

    def forget(self, pod: str) -> None:
        self._due.pop(pod, None)
        self._verdicts.pop(pod, None)
        self.mismatched.discard(pod)
        self.metrics.block_key_mismatched_pods.set(len(self.mismatched))


def matches(hasher: BlockHasher, probe: HashProbe) -> bool:
    tokens = probe.token_ids
    size = len(tokens)
    if hasher.event_hashes(tokens, size)[0] == probe.block_hash:
        return True
    return any(hasher.event_hashes(tokens, d)[-1] == probe.block_hash for d in range(size // 2, 0, -1) if size % d == 0)


def diagnose(probe: HashProbe, seed: str | None) -> str:
    """Which usual setting would match the engine's hash, as advice for the log."""
    if probe.lookahead:
        return ("The engine hashes blocks with lookahead tokens (EAGLE/MTP speculative decoding): no index can "
                "follow that; set speculative_config.disable_lookahead_block_hashes=true on the engines.")
    for s in dict.fromkeys([seed, None, "0"]):
        for algo in HASH_ALGOS:
            if s is None and algo.startswith("xxhash"):
                continue
            if matches(BlockHasher(algo, s), probe):
                return f"The engine's hash matches hashAlgo={algo}, pythonHashSeed={s!r}: set blockKey to that."
    return ("No usual setting matches: check the engines' --prefix-caching-hash-algo and their PYTHONHASHSEED "
            "(a random seed cannot be followed by any index; set it on the engines).")
