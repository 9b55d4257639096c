"""An indexer replica with its HTTP API: the unit the Helm chart runs N times behind one Service."""

from __future__ import annotations

from api.app import HitRateApi
from api.server import HttpServer
from infra.metrics import Metrics
from schemas.block_hash import BlockHasher
from indexer.service import Indexer
from schemas.config import Config


class Replica:
    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.indexer = Indexer(cfg, self.metrics)
        self.api = HitRateApi(cfg.http, BlockHasher.for_block_key(cfg.blockKey), tiers=lambda: (self.indexer.l1, self.indexer.l3),
                              ready=self.indexer.is_ready, metrics=self.metrics, block_size=cfg.blockKey.blockSize)
        self.http = HttpServer(self.api.make_app(), cfg.http, self.metrics)

    async def start(self) -> None:
        await self.http.start()  # liveness answers while the index catches up; readiness waits
        await self.indexer.start()

    async def stop(self) -> None:
        await self.http.stop()
        await self.indexer.stop()
