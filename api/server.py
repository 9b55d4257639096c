"""Runs the aiohttp application with the configured limits and a graceful shutdown."""

from __future__ import annotations

import logging

from aiohttp import web

from schemas.config import HttpConfig

log = logging.getLogger(__name__)


class HttpServer:
    def __init__(self, app: web.Application, cfg: HttpConfig) -> None:
        self.cfg = cfg
        self.runner = web.AppRunner(
            app,
            shutdown_timeout=cfg.shutdownTimeout,
            keepalive_timeout=cfg.idleTimeout,
            max_line_size=cfg.maxHeaderBytes,
            max_field_size=cfg.maxHeaderBytes,
            access_log=None,
        )
        self.port = cfg.port

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port)
        await site.start()
        server = site._server  # the bound port, for port 0
        if server is not None and server.sockets:
            self.port = server.sockets[0].getsockname()[1]
        log.info("serving the API on http://%s:%d", self.cfg.host, self.port)

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish within http.shutdownTimeout."""
        await self.runner.cleanup()
