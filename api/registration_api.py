"""``POST /register``, ``POST /unregister``, ``GET /workers``: engines outside Kubernetes labels, as
Dynamo's standalone indexer and Mooncake's RFC #1403 indexer take them.

A registration is written to the records bucket (infra/registrations.py), where the active bridge picks
it up and subscribes as to a discovered pod (same replay, lifecycle and removal), and every replica
sees it. It survives restarts of both. Writing requires ``Authorization: Bearer <http.registrationToken>``
(the chart takes it from a Secret); without a token configured registration is off. Bounded: the body
(64 KiB), each field, the number of registered ranks (``http.maxRegistrations``). Refusals are counted
(``cache_indexer_registrations_refused_total{reason}``) and logged, with Dynamo's codes: 422 for JSON
that does not fit, 409 for a rank registered already or a block size that differs from the model's.

``/workers`` lists every target: registered ones, and the pods the active bridge subscribes to
(recorded by it), with where they come from and their state per rank: ``active`` (events indexed),
``subscribed`` (a bridge subscribes, no events yet), ``registered`` (no bridge has taken it up yet).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Annotated

import msgspec
from aiohttp import web

from cache_indexer.api.json_request import RequestError, UnprocessableRequest, decode_json
from cache_indexer.api.request_body import BodyRefused, closing_unread, read_body
from cache_indexer.infra.registrations import Registration, RegistrationStore
from cache_indexer.infra.streams import RecordsKv
from cache_indexer.infra.targets_record import read_endpoints
from cache_indexer.infra.throttled_log import ThrottledWarning
from cache_indexer.schemas.api import MAX_NAME_CHARS
from cache_indexer.schemas.config import HttpConfig

log = logging.getLogger(__name__)

REGISTER_PATH, UNREGISTER_PATH, WORKERS_PATH = "/register", "/unregister", "/workers"
#: A registration is a few short fields: a larger body is refused before it is read
REGISTER_MAX_BYTES = 64 * 1024
_Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
_Endpoint = Annotated[str, msgspec.Meta(max_length=1024)]
_InstanceId = int | Annotated[str, msgspec.Meta(max_length=128)]


class _Register(msgspec.Struct):
    """Dynamo's /register fields (Mooncake's spellings too); unknown ones are ignored, as there."""

    instance_id: _InstanceId
    endpoint: _Endpoint
    block_size: int
    model_name: _Name | None = None
    model: _Name | None = None
    dp_rank: int = 0
    replay_endpoint: _Endpoint | None = None
    routing_group: _Name | None = None
    tenant_id: _Name | None = None
    lora_name: _Name = ""


class _Unregister(msgspec.Struct):
    instance_id: _InstanceId
    dp_rank: int | None = None


_register_decoder = msgspec.json.Decoder(_Register)
_unregister_decoder = msgspec.json.Decoder(_Unregister)


def _instance_id(value: int | str) -> str:
    if isinstance(value, int):
        if not 0 <= value < 1 << 64:
            raise UnprocessableRequest("instance_id: an unsigned 64-bit integer, or a name")
        return str(value)
    return value


def _id_out(instance_id: str) -> int | str:
    """As Dynamo writes it: an integer where the id is one."""
    return int(instance_id) if instance_id.isdigit() else instance_id


class _Refused(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


class RegistrationApi:
    def __init__(self, http: HttpConfig, block_size: int, discovery_source: str,
                 store: Callable[[], RegistrationStore | None], records: Callable[[], RecordsKv | None],
                 l1: Callable, metrics) -> None:
        """``discovery_source``: what /workers calls discovered pods ("labels" or "file"); ``store``,
        ``records``: None until the replica is connected; ``l1``: the replica's L1 state."""
        self.http = http
        self.block_size = block_size
        self.discovery_source = discovery_source
        self.store = store
        self.records = records
        self.l1 = l1
        self.metrics = metrics
        self._warn = ThrottledWarning(log, every=10.0)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(REGISTER_PATH, self.register, expect_handler=self._expect)
        app.router.add_post(UNREGISTER_PATH, self.unregister, expect_handler=self._expect)
        app.router.add_get(WORKERS_PATH, self.workers)

    async def _expect(self, request: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: a caller without the token is refused before it sends the body."""
        try:
            self._check_token(request)
        except _Refused as exc:
            return self._refused(request, exc)
        if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    async def register(self, request: web.Request) -> web.Response:
        try:
            store, body = await self._authorized_body(request)
            req = decode_json(_register_decoder, body, UnprocessableRequest)
            model = req.model_name if req.model_name is not None else req.model
            if model is None:
                raise UnprocessableRequest("missing field `model_name`")
            reg = Registration(instance_id=_instance_id(req.instance_id), dp_rank=req.dp_rank, endpoint=req.endpoint,
                               replay_endpoint=req.replay_endpoint, model_name=model,
                               routing_group=req.routing_group or req.tenant_id or "default", block_size=req.block_size,
                               lora_name=req.lora_name)
            problem = reg.problem()
            if problem:
                raise _Refused(400, "invalid", problem)
            current = store.current
            if len(current) >= self.http.maxRegistrations:
                raise _Refused(409, "limit", f"http.maxRegistrations ({self.http.maxRegistrations}) ranks are "
                                             "registered already")
            for other in current.values():
                if (other.model_name, other.routing_group) == (model, reg.routing_group) and \
                        other.block_size != reg.block_size:
                    raise _Refused(409, "block_size", f"block_size mismatch for model={model} routing_group="
                                                      f"{reg.routing_group}: existing={other.block_size}, "
                                                      f"requested={reg.block_size}")
            if not await store.create(reg):
                raise _Refused(409, "duplicate", f"instance {reg.instance_id} dp_rank {reg.dp_rank} already registered")
        except (_Refused, RequestError, BodyRefused) as exc:
            return self._refused(request, exc)
        log.info("registered instance %s rank %d at %s (replay %s), model %s", reg.instance_id, reg.dp_rank,
                 reg.endpoint, reg.replay_endpoint or "off", reg.model_name)
        return web.json_response({"status": "ok"}, status=201)

    async def unregister(self, request: web.Request) -> web.Response:
        try:
            store, body = await self._authorized_body(request)
            req = decode_json(_unregister_decoder, body, UnprocessableRequest)
            instance = _instance_id(req.instance_id)
            gone = await store.delete(instance, req.dp_rank)
            if not gone:
                raise _Refused(404, "unknown", f"instance {instance} is not registered"
                                               + (f" with dp_rank {req.dp_rank}" if req.dp_rank is not None else ""))
        except (_Refused, RequestError, BodyRefused) as exc:
            return self._refused(request, exc)
        log.info("unregistered instance %s (%d rank(s))", instance, len(gone))
        return web.json_response({"status": "ok"})

    def _check_token(self, request: web.Request) -> None:
        token = self.http.registrationToken.get_secret_value()
        if not token:
            raise _Refused(403, "off", "registration is off: set http.registrationToken (the chart: "
                                       "registration.enabled)")
        given = request.headers.get("Authorization", "")
        # the header's bytes as they came (aiohttp decodes them as UTF-8 with surrogates for the bad ones)
        if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode()):
            raise _Refused(401, "unauthenticated", "Authorization: Bearer <registration token> is missing or wrong")

    async def _authorized_body(self, request: web.Request) -> tuple[RegistrationStore, bytes]:
        self._check_token(request)
        store = self.store()
        if store is None or not store.synced.is_set():
            raise _Refused(503, "not_ready", "registrations are not readable yet (the replica is starting, or NATS "
                                             "is unreachable): try again")
        return store, await read_body(request, REGISTER_MAX_BYTES, self.http.readTimeout)

    def _refused(self, request: web.Request, exc: Exception) -> web.Response:
        if isinstance(exc, _Refused):
            status, reason = exc.status, exc.reason
        elif isinstance(exc, BodyRefused):
            status, reason = exc.status, "body"
        else:
            status, reason = (422 if isinstance(exc, UnprocessableRequest) else 400), "invalid"
        self.metrics.registrations_refused.labels(reason).inc()
        self._warn("%s %s from %s refused (%d): %s", request.method, request.path, request.remote, status, exc)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return closing_unread(request, web.json_response({"error": str(exc)}, status=status, headers=headers))

    async def workers(self, request: web.Request) -> web.Response:
        """Every target, by instance: Dynamo's /workers items, ``source`` and ``status`` ours."""
        l1 = self.l1()
        store, records = self.store(), self.records()
        subscribed: dict[tuple[str, int], list] = {}
        if records is not None:
            try:
                for pod, rank, pub, replay, name in await read_endpoints(records) or ():
                    subscribed[(pod, rank)] = [pub, replay, name]
            except Exception as exc:  # the record is an extra: the registrations are still listed
                self._warn("bridge targets record unreadable for /workers: %s", exc)
        out: dict[str, dict] = {}
        for reg in (store.current.values() if store is not None else ()):
            item = out.setdefault(reg.instance_id, self._item(reg.instance_id, "registration", reg.model_name,
                                                             reg.routing_group, reg.block_size))
            self._rank(item, l1, reg.instance_id, reg.dp_rank, reg.endpoint, (reg.instance_id, reg.dp_rank) in subscribed)
        for (pod, rank), (pub, _, name) in sorted(subscribed.items()):
            if name == "registration":
                continue  # listed above (or unregistered since the bridge recorded it)
            item = out.setdefault(pod, self._item(pod, self.discovery_source, "", "default", self.block_size))
            self._rank(item, l1, pod, rank, pub, True)
        for item in out.values():
            states = {listener["status"] for listener in item["listeners"].values()}
            item["status"] = "active" if "active" in states else "subscribed" if "subscribed" in states else "registered"
        return web.json_response(list(out.values()))

    @staticmethod
    def _item(instance: str, source: str, model: str, group: str, block_size: int) -> dict:
        return {"instance_id": _id_out(instance), "source": source, "status": "", "model_name": model,
                "routing_group": group, "block_size": block_size, "endpoints": {}, "listeners": {}}

    @staticmethod
    def _rank(item: dict, l1, pod: str, rank: int, endpoint: str, subscribed: bool) -> None:
        active = l1 is not None and (pod, rank) in getattr(l1, "cursors", {})  # events of it were applied
        item["endpoints"][str(rank)] = endpoint
        item["listeners"][str(rank)] = {"endpoint": endpoint,
                                        "status": "active" if active else "subscribed" if subscribed else "registered"}
