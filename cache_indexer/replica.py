"""An indexer replica with its HTTP API: the unit the Helm chart runs N times behind one Service."""

from __future__ import annotations

from cache_indexer.api.app import HitRateApi
from cache_indexer.api.registration_api import RegistrationApi
from cache_indexer.api.server import HttpServer
from cache_indexer.indexer.service import Indexer
from cache_indexer.infra.metrics import Metrics
from cache_indexer.infra.registrations import RegistrationStore
from cache_indexer.infra.streams import RecordsKv, records_bucket
from cache_indexer.schemas.block_hash import BlockHasher
from cache_indexer.schemas.config import Config


class Replica:
    def __init__(self, cfg: Config, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.indexer = Indexer(cfg, self.metrics)
        #: the registered engines, followed once the replica is connected (None before)
        self.registrations: RegistrationStore | None = None
        self._records: RecordsKv | None = None
        registration = RegistrationApi(cfg.http, cfg.blockKey.blockSize,
                                       "labels" if cfg.discovery.mode == "kubernetes" else "file",
                                       lambda: self.registrations, lambda: self._records, lambda: self.indexer.l1,
                                       self.metrics)
        self.api = HitRateApi(cfg.http, BlockHasher.for_block_key(cfg.blockKey), tiers=lambda: (self.indexer.l1, self.indexer.l3),
                              ready=self.indexer.is_ready, metrics=self.metrics, block_size=cfg.blockKey.blockSize,
                              registrations=lambda: self.registrations, more_routes=[registration],
                              records=lambda: self._records)
        self.http = HttpServer(self.api.make_app(), cfg.http, self.metrics)

    async def start(self) -> None:
        await self.http.start()  # liveness answers while the index catches up; readiness waits
        await self.indexer.start()
        bucket, replicas = records_bucket(self.cfg), self.cfg.nats.replicas
        self._records = RecordsKv(self.indexer.js, bucket, replicas)
        self.registrations = RegistrationStore(self.indexer.js, bucket, replicas,
                                               on_error=self.metrics.registration_errors.inc, nc=self.indexer.nc)
        self.registrations.follow()

    async def stop(self) -> None:
        await self.http.stop()
        if self.registrations is not None:
            await self.registrations.stop()
        await self.indexer.stop()
