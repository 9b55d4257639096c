"""``cache-indexer``: one command, a subcommand per component.

    cache-indexer local      all-in-one: a local nats-server, the bridge (static targets) and one
                             indexer replica serving the API on 127.0.0.1:28080
    cache-indexer bridge     vLLM ZMQ events -> JetStream
    cache-indexer indexer    an indexer replica with the HTTP API
    cache-indexer events     view|tail: print the L1 stream human-readably
    cache-indexer config     print the effective configuration
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path

from cache_indexer.config_loader import ConfigError, load_config
from schemas.config import Config

log = logging.getLogger("cache_indexer")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)), "level": record.levelname.lower(),
               "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(cfg: Config) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if cfg.log.format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(cfg.log.level.upper())


async def _until_signalled(stop_fns) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down")
    for fn in stop_fns:
        try:
            await fn()
        except Exception:
            log.exception("error during shutdown")


async def run_bridge(cfg: Config) -> None:
    from api.ops import make_ops_app
    from api.server import HttpServer
    from bridge.service import Bridge

    bridge = Bridge(cfg)
    http = HttpServer(make_ops_app(bridge.metrics, bridge.is_ready, "not connected to NATS"), cfg.http, bridge.metrics)
    await http.start()  # health and metrics of the bridge
    await bridge.start()
    await _until_signalled([http.stop, bridge.stop])


async def run_indexer(cfg: Config) -> None:
    from cache_indexer.replica import Replica

    replica = Replica(cfg)
    await replica.start()
    await _until_signalled([replica.stop])


async def run_local(cfg: Config) -> None:
    """Everything in one process, for a laptop: embedded nats-server unless nats.embedded=false."""
    from bridge.service import Bridge
    from cache_indexer.metrics import Metrics
    from cache_indexer.nats_server import NatsServer
    from cache_indexer.replica import Replica

    server = None
    if cfg.nats.embedded:
        server = NatsServer(store_dir=cfg.nats.embeddedStoreDir or None).start()
        cfg = cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"url": server.url})})
        log.info("embedded nats-server at %s (store %s)", server.url, server.store_dir)
    metrics = Metrics()
    bridge = Bridge(cfg, metrics)
    replica = Replica(cfg, metrics)
    await bridge.start()
    await replica.start()

    async def _stop_server() -> None:
        if server is None:
            return
        if cfg.nats.embeddedStoreDir:
            server.stop()  # keep the configured store: the next start replays it
        else:
            server.close()  # a temporary store goes with the server

    await _until_signalled([replica.stop, bridge.stop, _stop_server])


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", help="YAML configuration file (the Helm values' shape)")
    common.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="override one field, e.g. --set http.port=8080 (repeatable)")
    p = argparse.ArgumentParser(prog="cache-indexer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    local = sub.add_parser("local", parents=[common], help="all-in-one local mode")
    local.add_argument("--targets", help="static targets file (default: discovery.static.file)")
    sub.add_parser("bridge", parents=[common], help="run the bridge")
    sub.add_parser("indexer", parents=[common], help="run an indexer replica with the API")
    ev = sub.add_parser("events", parents=[common], help="print stream events")
    ev.add_argument("mode", choices=["view", "tail"])
    ev.add_argument("--subject", help="subject filter, e.g. 'kvcache.l1.10_0_0_1.>'")
    ev.add_argument("--last", type=int, default=0, help="start this many messages before the end")
    ev.add_argument("--tier", choices=["l1", "l3"], default="l1", help="the L1 (vLLM) or L3 (Mooncake) stream")
    cfg = sub.add_parser("config", parents=[common], help="print the effective configuration as YAML")
    cfg.add_argument("action", choices=["show"], nargs="?", default="show")
    return p


LOCAL_DEFAULTS = {"http": {"host": "127.0.0.1"}, "nats": {"embedded": True}}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    overrides = list(args.set)
    if getattr(args, "targets", None):
        overrides.append(f"discovery.static.file={args.targets}")
    try:
        cfg = load_config(args.config, overrides=overrides, base=LOCAL_DEFAULTS if args.cmd == "local" else None)
    except ConfigError as exc:
        print(f"cache-indexer: {exc}", file=sys.stderr)
        return 2
    setup_logging(cfg)
    if args.cmd == "config":
        import yaml

        print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
        return 0
    if args.cmd == "events":
        from cache_indexer.inspect_events import run

        return asyncio.run(run(cfg, args.mode, args.subject, args.last, tier=args.tier))
    if args.cmd == "local" and not Path(cfg.discovery.static.file).exists():
        print(f"cache-indexer: targets file {cfg.discovery.static.file} not found "
              "(see examples/targets.yaml; pass --targets FILE)", file=sys.stderr)
        return 2
    runner = {"bridge": run_bridge, "indexer": run_indexer, "local": run_local}[args.cmd]
    asyncio.run(runner(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
