"""Operational endpoints every process serves: ``/healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from cache_indexer.metrics import Metrics


def add_ops_routes(app: web.Application, metrics: Metrics, ready: Callable[[], bool],
                   not_ready_reason: str = "not ready") -> None:
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": not_ready_reason}, status=503)

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)


def make_ops_app(metrics: Metrics, ready: Callable[[], bool], not_ready_reason: str = "not ready") -> web.Application:
    app = web.Application()
    add_ops_routes(app, metrics, ready, not_ready_reason)
    return app
