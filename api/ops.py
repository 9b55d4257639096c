"""Operational endpoints every process serves: ``/healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from cache_indexer.infra.metrics import Metrics


def add_ops_routes(app: web.Application, metrics: Metrics, ready: Callable[[], bool],
                   not_ready_reason: str | Callable[[], str] = "not ready") -> None:
    """``not_ready_reason``: the 503's status text, or what says it when asked."""
    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if ready():
            return web.json_response({"status": "ready"})
        reason = not_ready_reason() if callable(not_ready_reason) else not_ready_reason
        return web.json_response({"status": reason}, status=503)

    async def metrics_handler(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)


def make_ops_app(metrics: Metrics, ready: Callable[[], bool],
                 not_ready_reason: str | Callable[[], str] = "not ready") -> web.Application:
    app = web.Application()
    add_ops_routes(app, metrics, ready, not_ready_reason)
    return app
