"""The L3 index: which pods' Mooncake memory segments hold which block hashes.

Same layout as L1 (hash -> bitmask of workers); a worker is (pod IP, master), so a pod's L3 ratio is
the best over the masters that report it. ``l3_full`` replaces everything one master reported,
``l3_diff`` adds and removes pairs; the bridge already reference-counts keys, so presence is enough.
"""

from __future__ import annotations

from indexer.l1_index import BlockIndex, WorkerTable


class L3State:
    def __init__(self) -> None:
        self.workers = WorkerTable()
        self.index = BlockIndex()
        self._masters: dict[str, int] = {}
        self.messages = 0

    @property
    def blocks(self) -> dict[int, int]:
        return self.index.blocks

    def pod_workers(self, pod: str) -> dict[int, int]:
        return self.workers.pod_workers(pod)

    def knows(self, pod: str) -> bool:
        return bool(self.pod_workers(pod))  # L3 has no per-pod history beyond what it holds

    def _master(self, name: str) -> int:
        return self._masters.setdefault(name, len(self._masters))

    def apply(self, msg: dict) -> None:
        kind = msg.get("type")
        m = self._master(msg["master"])
        if kind == "l3_full":
            for (pod, master), wid in list(self.workers.items()):
                if master == m:
                    self.index.clear(wid)
                    self.workers.release(pod, master)
            for pod, hashes in msg["pods"].items():
                self.index.store(self.workers.intern(pod, m), hashes)
        elif kind == "l3_diff":
            for pod, hashes in msg["removed"].items():
                wid = self.workers.get(pod, m)
                if wid is not None:
                    self.index.remove(wid, hashes)
            for pod, hashes in msg["added"].items():
                self.index.store(self.workers.intern(pod, m), hashes)
        else:
            raise ValueError(f"unknown L3 message type {kind!r}")
        self.messages += 1
