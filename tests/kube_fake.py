"""A Kubernetes API endpoint on 127.0.0.1 that serves real pod list/watch JSON for the discovery tests.

``GET /api/v1/namespaces/<ns>/pods`` answers a PodList (filtered by ``labelSelector``, paged by ``limit``
and ``continue``) with a resourceVersion; with ``watch=true`` it streams ``{"type": ADDED|MODIFIED|DELETED|
BOOKMARK|ERROR, "object": ...}`` lines from the given resourceVersion until ``timeoutSeconds``, as the
API server does. The test drives what a real cluster does to a watch: the server ending it
(``watch_timeout``), history compacted (``compact()``: 410 Gone on resume; ``expire()``: 410 Gone to the
open watches too), broken connections (``break_watches()``), errors (``fail_watches()``), a watch that
goes silent (``stall_watches()``) and a gap while no watch is open (``hold_watches()``).
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web


def make_pod(name: str, ip: str, *, ns: str = "infer", ready: bool = True, phase: str = "Running",
             role: str = "aggregate", engine: str = "vllm", zmq_port: int = 5557, replay_port: int | None = None,
             restarts: int = 0, annotations: dict | None = None) -> dict:
    ports = [{"name": "http", "containerPort": 8000, "protocol": "TCP"},
             {"name": "zmq-pub", "containerPort": zmq_port, "protocol": "TCP"}]
    if replay_port:
        ports.append({"name": "zmq-replay", "containerPort": replay_port, "protocol": "TCP"})
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "resourceVersion": "0",
                     "creationTimestamp": "2026-12-01T00:00:00Z",
                     "labels": {"openfuyao.com/engine": engine, "openfuyao.com/pdRole": role, "app": name},
                     "annotations": annotations or {}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.33.0", "ports": ports}],
                 "nodeName": "node-1"},
        "status": {
            "phase": phase, "podIP": ip if phase == "Running" else None, "podIPs": [{"ip": ip}] if phase == "Running" else [],
            "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                            "lastTransitionTime": "2026-12-01T00:00:05Z"}],
            "containerStatuses": [{"name": "vllm", "ready": ready, "restartCount": restarts, "started": True,
                                   "image": "vllm/vllm-openai:v0.33.0", "imageID": "sha256:abc",
                                   "containerID": f"containerd://{uuid.uuid4().hex}",
                                   "state": {"running": {"startedAt": "2026-12-01T00:00:01Z"}}}],
        },
    }


def _matches(pod: dict, selector: str) -> bool:
    labels = pod["metadata"].get("labels", {})
    for term in filter(None, (selector or "").split(",")):
        k, _, v = term.partition("=")
        if labels.get(k) != v:
            return False
    return True


class FakeKubeApi:
    """``list_calls`` counts list operations (a first page; ``list_pages`` counts every page),
    ``watch_calls`` watch requests, and ``watch_requests`` keeps each one's query parameters.

    As the real API server: ``watch_timeout`` caps every watch's ``timeoutSeconds`` (the real one ends a
    watch at the client's timeoutSeconds, or after 30-60 min); with ``allowWatchBookmarks=true`` a BOOKMARK
    with the latest resourceVersion comes every ``bookmark_interval`` seconds (the real one: each minute)
    and just before the server ends the watch."""

    def __init__(self, *, watch_timeout: float | None = None, bookmark_interval: float = 60.0) -> None:
        self.pods: dict[str, dict] = {}
        self.rv = 100
        self.events: list[tuple[int, str, dict, dict | None]] = []
        self.compacted = 0
        self.watch_timeout = watch_timeout
        self.bookmark_interval = bookmark_interval
        self.gone_http = False  # a resume from a compacted version: an HTTP 410 instead of an ERROR event
        self._queues: list[asyncio.Queue] = []
        self._snapshots: dict[str, tuple[int, list[dict]]] = {}
        self._hold: asyncio.Event | None = None
        self._failures: list[int] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.list_calls = 0
        self.list_pages = 0
        self.watch_calls = 0
        self.watch_requests: list[dict[str, str]] = []
        self.watch_times: list[float] = []  # the event loop's time of each watch request

    async def start(self) -> "FakeKubeApi":
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._pods)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.release_watches()
        self.break_watches()
        await self._runner.cleanup()

    # -- changes -----------------------------------------------------------------------------------
    def _emit(self, kind: str, pod: dict) -> None:
        self.rv += 1
        pod = copy.deepcopy(pod)
        pod["metadata"]["resourceVersion"] = str(self.rv)
        old = self.pods.get(pod["metadata"]["name"])
        if kind == "DELETED":
            self.pods.pop(pod["metadata"]["name"], None)
        else:
            self.pods[pod["metadata"]["name"]] = pod
        self.events.append((self.rv, kind, pod, old))
        for q in self._queues:
            q.put_nowait((self.rv, kind, pod, old))

    def add(self, pod: dict) -> None:
        self._emit("ADDED", pod)

    def modify(self, pod: dict) -> None:
        self._emit("MODIFIED", pod)

    def delete(self, name: str) -> None:
        self._emit("DELETED", self.pods[name])

    def compact(self, rv: int | None = None) -> None:
        """The history before ``rv`` (default: now) is compacted, as etcd's is every 5 min: the open
        watches go on, a watch from an older resourceVersion gets 410 Gone."""
        self.compacted = self.rv if rv is None else rv
        self.events = [e for e in self.events if e[0] > self.compacted]

    def expire(self, *, http: bool = False) -> None:
        """``compact()``, and the open watches end with a 410 Gone ERROR event; with ``http`` a resume
        from an older version is answered with an HTTP 410 instead of the ERROR event."""
        self.compact()
        self.gone_http = http
        for q in self._queues:
            q.put_nowait("gone")

    @property
    def watching(self) -> int:
        """Open watch connections."""
        return len(self._queues)

    def break_watches(self) -> None:
        """The open watch connections are dropped (no end of the chunked body)."""
        for q in self._queues:
            q.put_nowait("break")

    def stall_watches(self) -> None:
        """The open watches go silent and never end (a half-open connection): only the client can end them."""
        for q in self._queues:
            q.put_nowait("stall")

    def error_watches(self, code: int) -> None:
        """The open watches end with an ERROR event of this ``code`` (a 500: the API server's trouble)."""
        for q in self._queues:
            q.put_nowait(code)

    def fail_watches(self, status: int, count: int = 1) -> None:
        """The next ``count`` watch requests are answered with HTTP ``status``."""
        self._failures += [status] * count

    def hold_watches(self) -> None:
        """New watch requests wait, unanswered, until ``release_watches()``: a gap with no watch open."""
        if self._hold is None:
            self._hold = asyncio.Event()

    def release_watches(self) -> None:
        if self._hold is not None:
            self._hold.set()
            self._hold = None

    @contextmanager
    def watches_held(self) -> Iterator[None]:
        self.hold_watches()
        try:
            yield
        finally:
            self.release_watches()

    # -- HTTP --------------------------------------------------------------------------------------
    @staticmethod
    def _status(code: int, reason: str, message: str) -> dict:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "code": code,
                "reason": reason, "message": message}

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("true", "1", "True"):
            return await self._watch(request, ns, selector)
        self.list_pages += 1
        token = request.query.get("continue")
        if token:
            if token not in self._snapshots:
                return web.json_response(self._status(410, "Expired", "the continue token expired"), status=410)
            rv, items = self._snapshots.pop(token)
        else:
            self.list_calls += 1
            rv = self.rv
            items = sorted((p for p in self.pods.values()
                            if p["metadata"]["namespace"] == ns and _matches(p, selector)),
                           key=lambda p: p["metadata"]["name"])
        limit = int(request.query.get("limit") or 0)
        meta: dict = {"resourceVersion": str(rv)}
        if 0 < limit < len(items):
            token = uuid.uuid4().hex
            self._snapshots[token] = (rv, items[limit:])
            meta.update({"continue": token, "remainingItemCount": len(items) - limit})
            items = items[:limit]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})

    async def _watch(self, request: web.Request, ns: str, selector: str) -> web.StreamResponse:
        self.watch_calls += 1
        self.watch_requests.append(dict(request.query))
        self.watch_times.append(asyncio.get_running_loop().time())
        if self._hold is not None:
            await self._hold.wait()
        if self._failures:
            code = self._failures.pop(0)
            return web.json_response(self._status(code, "InternalError", f"failing with {code} as told"), status=code)
        since = int(request.query.get("resourceVersion") or self.rv)
        if since < self.compacted and self.gone_http:
            return web.json_response(self._status(410, "Expired", f"too old resource version: {since}"), status=410)
        timeout = float(request.query.get("timeoutSeconds") or 1800)
        if self.watch_timeout is not None:
            timeout = min(timeout, self.watch_timeout)
        bookmarks = request.query.get("allowWatchBookmarks") in ("true", "1", "True")
        # the history to replay and the queue of what comes next, taken together: nothing twice, nothing lost
        backlog = [e for e in self.events if e[0] > since]
        q: asyncio.Queue = asyncio.Queue()
        self._queues.append(q)
        seen = self.rv  # every change up to here is in the backlog, every later one in the queue
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        loop = asyncio.get_running_loop()

        async def send(kind: str, obj: dict) -> None:
            await resp.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        async def send_filtered(kind: str, pod: dict, old: dict | None) -> None:
            """As the API server does for selector watches: leaving the selector is a DELETED."""
            if pod["metadata"]["namespace"] != ns:
                return
            new_m, old_m = _matches(pod, selector), old is not None and _matches(old, selector)
            if kind == "MODIFIED" and old_m != new_m:
                kind = "ADDED" if new_m else "DELETED"
            elif not new_m and not (kind == "DELETED" and old_m):
                return
            await send(kind, pod)

        async def bookmark() -> None:
            await send("BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(seen)}})

        try:
            await resp.prepare(request)
            if since < self.compacted:
                await send("ERROR", self._status(410, "Expired", f"too old resource version: {since}"))
                return resp
            for _, kind, pod, old in backlog:
                await send_filtered(kind, pod, old)
            deadline = loop.time() + timeout
            next_bookmark = loop.time() + self.bookmark_interval
            stalled = False
            while True:
                if q.empty():  # what is queued goes out first: a bookmark's version covers it
                    now = loop.time()
                    if stalled:
                        wait = None
                    elif now >= deadline:
                        if bookmarks:
                            await bookmark()
                        return resp
                    elif bookmarks and now >= next_bookmark:
                        await bookmark()
                        next_bookmark = now + self.bookmark_interval
                        continue
                    else:
                        wait = min(deadline, next_bookmark) - now if bookmarks else deadline - now
                    try:
                        item = await asyncio.wait_for(q.get(), wait)
                    except asyncio.TimeoutError:
                        continue
                else:
                    item = q.get_nowait()
                if item == "break":
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if stalled:
                    continue
                if item == "stall":
                    stalled = True
                elif item == "gone":
                    await send("ERROR", self._status(410, "Expired", "too old resource version"))
                    return resp
                elif isinstance(item, int):
                    await send("ERROR", self._status(item, "InternalError", f"failing with {item} as told"))
                    return resp
                else:
                    seen, kind, pod, old = item
                    await send_filtered(kind, pod, old)
        finally:
            self._queues.remove(q)
