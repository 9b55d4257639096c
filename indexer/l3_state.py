"""The L3 index: which pods' Mooncake memory segments hold which block hashes.

Same layout as L1 (hash -> bitmask of workers); a worker is (pod IP, master), so a pod's L3 ratio is
the best over the masters that report it. ``l3_full`` replaces everything one master reported,
``l3_diff`` adds and removes pairs; the bridge already reference-counts keys, so presence is enough.

Each worker's hashes are also kept (as the keys of a dict, which the garbage collector does not track):
a full state is applied as its difference to what the worker holds (key-set operations in C, then
only the changes touch the index), so a periodic full state
that changes nothing costs little, and dropping a worker never walks the whole index. A full state
in several parts is collected and applied when its last part arrives; parts that arrive out of order
or incomplete are dropped (counted) and the master's state stays as it was until the next full state.

Diffs are applied in their master's order: each L3 message carries the publishing bridge's ``origin``
and a ``seq`` (a full state's parts share one). A full state sets the order; a diff of that origin is
applied when its seq is the next one, kept (early) while an earlier one is missing (a publish re-sent after the
ack timeout arrives after later ones), and refused (counted in ``out_of_order``) when it is a repeat, of
an older origin, or early past MAX_EARLY_DIFFS: applied late, it would undo a newer change and stand
until the next full state. Messages without ``seq`` (older bridges) are applied as they come.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field

from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.indexer.block_index import TierIndex, TooManyWorkers

log = logging.getLogger(__name__)

#: Diffs of one master kept while an earlier one is missing; past it they wait for the next full state.
MAX_EARLY_DIFFS = 256


class MalformedL3Message(ValueError):
    """An L3 message outside the schema: refused whole, before any of it is applied."""


def checked_pods(pods, what: str) -> dict[str, list[int]]:
    """``pods`` (pod IP -> block hashes) checked whole: MalformedL3Message names what is outside the
    schema (every hash an int within uint64), so that nothing of a bad message is applied."""
    if type(pods) is not dict:
        raise MalformedL3Message(f"{what} is a {type(pods).__name__}, not a map")
    for pod, hashes in pods.items():
        if type(pod) is not str or type(hashes) is not list:
            raise MalformedL3Message(f"{what}: {pod!r} -> {type(hashes).__name__}: not pod IP -> list of hashes")
        try:
            array("Q", hashes)
        except (TypeError, OverflowError):
            raise MalformedL3Message(f"{what}: a block hash of {pod} is not a uint64") from None
    return pods


@dataclass(slots=True)
class _Order:
    """Where a master's diffs stand: the origin of its last full state and the next diff seq wanted."""
    origin: int
    next_seq: int
    early: dict[int, dict] = field(default_factory=dict)  # diffs ahead of a missing one, by seq


@dataclass(slots=True)
class _Parts:
    gen: int
    parts: int
    next: int = 0
    pods: dict[str, list[int]] = field(default_factory=dict)


class L3State(TierIndex):
    def __init__(self) -> None:
        super().__init__()
        self._masters: dict[str, int] = {}
        #: worker id -> its hashes, as dict keys (a dict of ints is not tracked by the garbage collector;
        #: a set would be traversed, 100k entries a worker, by every full collection)
        self._held: dict[int, dict[int, None]] = {}
        self._assembling: dict[str, _Parts] = {}
        self._order: dict[str, _Order] = {}
        self.messages = 0
        self.incomplete = 0  # full states dropped because a part was missing
        self.out_of_order = 0  # diffs refused: repeated, of an older origin, or early too long
        self._refused_log = ThrottledWarning(log, every=10.0)

    def knows(self, pod: str) -> bool:
        return bool(self.pod_workers(pod))  # L3 has no per-pod history beyond what it holds

    def _master(self, name: str) -> int:
        return self._masters.setdefault(name, len(self._masters))

    def apply(self, msg: dict) -> None:
        """Queries on other threads see the message applied wholly or not at all."""
        with self.index.batch():
            self._apply(msg)

    def _apply(self, msg: dict) -> None:
        kind = msg.get("type")
        master = msg["master"]
        if type(master) is not str:
            raise MalformedL3Message(f"master {master!r} is not a name")
        if kind == "l3_full":
            checked_pods(msg.get("pods"), "pods")
        elif kind == "l3_diff":
            checked_pods(msg.get("added"), "added")
            checked_pods(msg.get("removed"), "removed")
        m = self._master(master)
        if kind == "l3_full":
            pods = self._collect(master, msg)
            if pods is not None:
                self._replace(m, pods)
                self._ordered_from(master, msg)
        elif kind == "l3_diff":
            self._on_diff(master, m, msg)
        else:
            raise ValueError(f"unknown L3 message type {kind!r}")
        self.messages += 1

    def _ordered_from(self, master: str, full: dict) -> None:
        """A whole full state: its master's diffs go on after its seq (early ones that follow it apply)."""
        origin, seq = full.get("origin"), full.get("seq")
        if not (type(origin) is int and type(seq) is int):
            self._order.pop(master, None)  # an older bridge: diffs in arrival order
            return
        old = self._order.get(master)
        order = self._order[master] = _Order(origin, seq + 1)
        if old is not None and old.origin == origin:
            order.early = {s: d for s, d in old.early.items() if s > seq}
        self._apply_early(master, order)

    def _on_diff(self, master: str, m: int, msg: dict) -> None:
        origin, seq = msg.get("origin"), msg.get("seq")
        order = self._order.get(master)
        if order is None or not (type(origin) is int and type(seq) is int):
            self._apply_diff(m, msg)  # no order known yet (or an older bridge): as it comes
            return
        if origin != order.origin or seq < order.next_seq:
            if origin > order.origin:  # a newer bridge whose full state is still on its way: it resets the order
                order.early.clear()
                self._order[master] = order = _Order(origin, -1)
                order.early[seq] = msg
                return
            self._refuse(master, msg, "a repeat" if origin == order.origin else "of an older bridge")
            return
        if seq > order.next_seq:
            if len(order.early) < MAX_EARLY_DIFFS:
                order.early[seq] = msg
            else:
                self._refuse(master, msg, "too far ahead: the full state puts it right")
            return
        self._apply_diff(m, msg)
        order.next_seq += 1
        self._apply_early(master, order)

    def _apply_early(self, master: str, order: _Order) -> None:
        m = self._master(master)
        for seq in [s for s in order.early if s < order.next_seq]:
            del order.early[seq]
        while (msg := order.early.pop(order.next_seq, None)) is not None:
            self._apply_diff(m, msg)
            order.next_seq += 1

    def _refuse(self, master: str, msg: dict, why: str) -> None:
        self.out_of_order += 1
        self._refused_log("L3 diff %s of master %s refused (%s): applied now, it would undo a newer change",
                          msg.get("seq"), master, why)

    def _room_for(self, m: int, pods) -> None:
        """TooManyWorkers, before anything is applied, where the pods new to master m outnumber the free ids."""
        new = sum(1 for pod in pods if self.workers.get(pod, m) is None)
        if new > self.workers.room():
            raise TooManyWorkers(f"{new} pods new to L3 and {self.workers.room()} worker ids free: message refused")

    def _apply_diff(self, m: int, msg: dict) -> None:
        self._room_for(m, msg["added"])
        for pod, hashes in msg["removed"].items():
            wid = self.workers.get(pod, m)
            if wid is not None:  # (a hash listed twice is one: dict.fromkeys)
                held = self._held.get(wid, {})
                gone = [h for h in dict.fromkeys(hashes) if h in held]
                self.index.remove(wid, gone)
                for h in gone:
                    del held[h]
                self._release_if_empty(pod, m, wid)
        for pod, hashes in msg["added"].items():
            wid = self.workers.intern(pod, m)
            held = self._held.setdefault(wid, {})
            came = [h for h in dict.fromkeys(hashes) if h not in held]
            self.index.store(wid, came)
            held.update(dict.fromkeys(came))
            self._release_if_empty(pod, m, wid)

    def _collect(self, master: str, msg: dict) -> dict[str, list[int]] | None:
        """The whole full state once its last part is in; None while parts are missing."""
        parts, part = int(msg.get("parts", 1)), int(msg.get("part", 0))
        if parts == 1:
            self._assembling.pop(master, None)
            return msg["pods"]
        pending = self._assembling.get(master)
        if part == 0:
            if pending is not None:
                self._dropped(master, pending, "a new full state began")
            pending = self._assembling[master] = _Parts(msg.get("gen"), parts)
        elif pending is None or pending.gen != msg.get("gen") or pending.next != part or pending.parts != parts:
            if pending is not None:
                self._dropped(master, pending, f"part {part + 1}/{parts} of another sequence arrived")
                del self._assembling[master]
            return None
        for pod, hashes in msg["pods"].items():
            pending.pods.setdefault(pod, []).extend(hashes)
        pending.next += 1
        if pending.next < parts:
            return None
        del self._assembling[master]
        return pending.pods

    def _dropped(self, master: str, pending: _Parts, why: str) -> None:
        self.incomplete += 1
        log.warning("L3 full state of master %s dropped after %d of %d parts (%s); the previous state stands",
                    master, pending.next, pending.parts, why, extra={"master": master})

    def _replace(self, m: int, pods: dict[str, list[int]]) -> None:
        self._room_for(m, pods)
        for (pod, master), wid in list(self.workers.items()):
            if master == m and pod not in pods:
                self._set(pod, m, wid, {})
        for pod, hashes in pods.items():
            wid = self.workers.intern(pod, m)
            self._set(pod, m, wid, dict.fromkeys(hashes))

    def _set(self, pod: str, m: int, wid: int, new: dict[int, None]) -> None:
        """Make worker ``wid`` hold exactly ``new``; a worker left with nothing is released."""
        old = self._held.get(wid, {})
        gone, came = old.keys() - new.keys(), new.keys() - old.keys()
        if gone:
            self.index.remove(wid, gone)
        if came:
            self.index.store(wid, came)
        self._held[wid] = new
        self._release_if_empty(pod, m, wid)

    def _release_if_empty(self, pod: str, m: int, wid: int) -> None:
        """A worker left with nothing goes; its id's generation moves on (``TierIndex.release``), so a
        query prepared for this pod never counts what the pod that reuses the id holds."""
        if not self._held.get(wid):
            self._held.pop(wid, None)
            self.release(pod, m)
