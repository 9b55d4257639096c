"""Runs the aiohttp application with the configured limits and a graceful shutdown."""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from cache_indexer.api.fast_path import FAST_ROUTES
from cache_indexer.api.header_guard import ROUTED, HeaderGuard
from cache_indexer.api.request_body import BODY_BUDGET
from cache_indexer.infra.loop_lag import LoopLagMonitor
from cache_indexer.schemas.config import HttpConfig

log = logging.getLogger(__name__)


def _counting_refusals(metrics) -> type[AbstractAccessLogger]:
    """An access "logger" that logs nothing (aiohttp's own log says why it refused a request) but counts,
    in ``http_requests_total{path="other"}``, the requests aiohttp answered before any middleware ran:
    those its parser refused (a malformed request line or header, one over its line and field limits)."""

    class CountRefusals(AbstractAccessLogger):
        def log(self, request, response, time: float) -> None:
            if ROUTED not in request:
                metrics.http_requests.labels("other", str(response.status)).inc()
                metrics.http_latency.labels("other", str(response.status)).observe(time)

    return CountRefusals


class HttpServer:
    def __init__(self, app: web.Application, cfg: HttpConfig, metrics=None) -> None:
        self.cfg = cfg
        on_timeout = metrics.http_header_timeouts.inc if metrics is not None else (lambda: None)
        on_too_large = metrics.http_headers_too_large.inc if metrics is not None else (lambda: None)
        self.guard = HeaderGuard(cfg.readHeaderTimeout, cfg.maxHeaderBytes, on_timeout, on_too_large,
                                 fast_routes=app.get(FAST_ROUTES), max_body=cfg.maxHitRateBodyBytes,
                                 body_budget=app.get(BODY_BUDGET), body_timeout=cfg.readTimeout,
                                 idle_timeout=cfg.idleTimeout, write_timeout=cfg.writeTimeout,
                                 shutdown_timeout=cfg.shutdownTimeout)
        app.middlewares.insert(0, self.guard.middleware)
        self.runner = web.AppRunner(
            app,
            shutdown_timeout=cfg.shutdownTimeout,
            keepalive_timeout=cfg.idleTimeout,
            max_line_size=cfg.maxHeaderBytes,
            max_field_size=cfg.maxHeaderBytes,
            access_log=log if metrics is not None else None,
            access_log_class=_counting_refusals(metrics) if metrics is not None else web.AccessLogger,
            # a body answered before its end (413, 408, 400) is not read on: the connection closes after
            # the answer. aiohttp's lingering close read up to 10 s more of it, inflating a compressed one
            # on the loop, and held a stalled sender's connection (and the shutdown) that long
            lingering_time=0,
        )
        self.port = cfg.port
        #: the event loop's pauses, as the process serving this API sees them
        self.loop_lag = LoopLagMonitor(metrics) if metrics is not None else None

    async def start(self) -> None:
        await self.runner.setup()
        site = self.guard.site(self.runner, self.cfg.host, self.cfg.port)
        await site.start()
        self.port = site.port
        if self.loop_lag is not None:
            self.loop_lag.start()
        log.info("serving the API on http://%s:%d", self.cfg.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish within http.shutdownTimeout."""
        await self.runner.cleanup()
        if self.loop_lag is not None:
            await self.loop_lag.stop()
