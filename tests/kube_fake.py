"""A Kubernetes API endpoint on 127.0.0.1 that serves real pod list/watch JSON for the discovery tests.

``GET /api/v1/namespaces/<ns>/pods`` answers a PodList (filtered by ``labelSelector``) with a
resourceVersion; with ``watch=true`` it streams ``{"type": ADDED|MODIFIED|DELETED, "object": pod}``
lines from the given resourceVersion, until ``timeoutSeconds``. After ``expire()`` older resource
versions get the API server's 410 Gone ERROR event. ``break_watches()`` drops open watch connections.
"""

from __future__ import annotations

import asyncio
import copy
import json
import uuid

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
    def __init__(self) -> None:
        self.pods: dict[str, dict] = {}
        self.rv = 100
        self.events: list[tuple[int, str, dict, dict | None]] = []
        self.compacted = 0
        self._queues: list[asyncio.Queue] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.list_calls = 0
        self.watch_calls = 0

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

    def expire(self) -> None:
        """History before now is compacted: watches from older versions get 410 Gone."""
        self.compacted = self.rv
        for q in self._queues:
            q.put_nowait("gone")

    @property
    def watching(self) -> int:
        """Open watch connections."""
        return len(self._queues)

    def break_watches(self) -> None:
        for q in self._queues:
            q.put_nowait("break")

    # -- HTTP --------------------------------------------------------------------------------------
    async def _pods(self, request: web.Request) -> web.StreamResponse:
        ns = request.match_info["ns"]
        selector = request.query.get("labelSelector", "")
        if request.query.get("watch") in ("true", "1", "True"):
            return await self._watch(request, ns, selector)
        self.list_calls += 1
        items = [p for p in self.pods.values() if p["metadata"]["namespace"] == ns and _matches(p, selector)]
        return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    async def _watch(self, request: web.Request, ns: str, selector: str) -> web.StreamResponse:
        self.watch_calls += 1
        since = int(request.query.get("resourceVersion") or self.rv)
        timeout = float(request.query.get("timeoutSeconds") or 300)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        q: asyncio.Queue = asyncio.Queue()
        self._queues.append(q)

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

        try:
            if since < self.compacted:
                await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                     "reason": "Expired", "message": f"too old resource version: {since}"})
                return resp
            for rv, kind, pod, old in self.events:
                if rv > since:
                    await send_filtered(kind, pod, old)
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    return resp
                try:
                    item = await asyncio.wait_for(q.get(), remaining)
                except asyncio.TimeoutError:
                    return resp
                if item == "break":
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if item == "gone":
                    await send("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                                         "reason": "Expired", "message": "too old resource version"})
                    return resp
                _, kind, pod, old = item
                await send_filtered(kind, pod, old)
        finally:
            self._queues.remove(q)
