"""cache-indexer: one command, a subcommand per component.

  local      all-in-one for a laptop: an embedded nats-server, the bridge (static targets) and one
             indexer replica serving the API on 127.0.0.1:28080
  simulate   simulated vLLM engines that feed a running `local` (or a targets file you name)
  bridge     vLLM ZMQ events and Mooncake masters -> JetStream
  indexer    an indexer replica with the HTTP API
  events     view|tail: print the L1 or L3 stream as JSON lines; decode: one payload (nats --translate)
  config     show: print the effective configuration
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from cache_indexer import __version__

if TYPE_CHECKING:  # imported where used: `events decode` runs once per message and imports none of it
    from cache_indexer.schemas.config import Config

log = logging.getLogger("cache_indexer")
#: The configuration file when --config is not given (the chart sets it in its pods, so commands run with
#: `kubectl exec` find the same NATS server as the process).
CONFIG_ENV = "CACHE_INDEXER_CONFIG"

Step = Callable[[], Awaitable[None]]
#: The C accelerators setup.py builds (optional: without them the pure-Python paths run)
NATIVE_MODULES = (
    "cache_indexer.schemas._blockhash", "cache_indexer.indexer._prefix_walk", "cache_indexer.indexer._native_index", "cache_indexer.bridge._zmq_drain", "cache_indexer.bridge._vllm_decode",
    "cache_indexer.infra._event_unpack", "cache_indexer.api._answer_json")


def setup_logging(cfg: Config) -> None:
    from cache_indexer.infra.log_format import configure

    configure(cfg.log.level, cfg.log.format)


async def serve(start: list[Step], stop: list[Step], shutdown_timeout: float,
                on_second_signal: Callable[[], None] = lambda: None) -> int:
    """Run the start steps, wait for SIGINT/SIGTERM, run the stop steps in order within ``shutdown_timeout``.

    The handlers are installed first, so a signal during start-up cancels it and still runs every stop
    step (each must cope with a half-started component). A second signal ends the process at once.
    Returns the exit code: 0 after a signal, 1 when start-up failed."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()

    def _on_signal(signame: str) -> None:
        if stopping.is_set():
            log.warning("%s again: exiting now", signame)
            on_second_signal()
            os._exit(130)
        log.info("%s: shutting down", signame)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig.name)

    async def _start_all() -> None:
        for step in start:
            await step()

    code = 0
    starting = asyncio.create_task(_start_all(), name="start-up")
    waiter = asyncio.create_task(stopping.wait(), name="wait-for-signal")
    await asyncio.wait({starting, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        log.error("start-up failed: %s", starting.exception(), exc_info=starting.exception())
        code = 1
    elif starting.done():
        # What start-up made (every imported module: ~90k objects) will live as long as the process:
        # out of the collector's sight, a full collection costs a few ms instead of ~50 ms of the loop.
        gc.freeze()
        await waiter
    else:
        from cache_indexer.infra.tasks import cancel_and_wait

        await cancel_and_wait(starting)
    waiter.cancel()

    async def _stop_all() -> None:
        for step in stop:
            try:
                await step()
            except Exception:
                log.exception("error during shutdown")

    began = time.monotonic()
    try:
        await asyncio.wait_for(_stop_all(), shutdown_timeout or None)
    except asyncio.TimeoutError:
        log.warning("shutdown did not finish within http.shutdownTimeout (%.1fs); exiting", shutdown_timeout)
    log.info("stopped in %.2fs", time.monotonic() - began)
    return code


def check_port_free(host: str, port: int) -> str | None:
    """The reason the API port cannot be bound, or None. Checked before anything starts, so a busy port
    costs one line instead of a traceback and a half-started process."""
    if not port:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if os.name != "nt":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"port {port} on {host} is in use"
            return f"cannot bind {host}:{port}: {exc.strerror or exc}"
    return None


def process_metrics(component: str | None):
    """The process's registry: its own component's metrics (None: local mode's, all), and its build."""
    from importlib.util import find_spec

    from cache_indexer.infra.metrics import Metrics

    metrics = Metrics(component)
    metrics.set_build_info(native=all(find_spec(m) is not None for m in NATIVE_MODULES))
    return metrics


async def run_bridge(cfg: Config) -> int:
    from cache_indexer.api.ops import make_ops_app
    from cache_indexer.api.server import HttpServer
    from cache_indexer.bridge.service import Bridge

    bridge = Bridge(cfg, process_metrics("bridge"))
    http = HttpServer(make_ops_app(bridge.metrics, bridge.is_ready, bridge.not_ready_reason), cfg.http, bridge.metrics)
    return await serve([http.start, bridge.start], [http.stop, bridge.stop], cfg.http.shutdownTimeout)


async def run_indexer(cfg: Config) -> int:
    from cache_indexer.replica import Replica

    replica = Replica(cfg, process_metrics("indexer"))
    return await serve([replica.start], [replica.http.stop, replica.indexer.stop], cfg.http.shutdownTimeout)


async def run_local(cfg: Config) -> int:
    """Everything in one process, for a laptop: embedded nats-server unless nats.embedded=false.

    Shutdown goes in order: stop accepting and drain the API, stop the bridge and the indexer, then the
    server. The server runs in its own session (a terminal's Ctrl-C reaches only this process) and dies
    with this process, so nothing is left behind whichever process gets the signal."""
    from cache_indexer.bridge.service import Bridge
    from cache_indexer import runtime_file
    from cache_indexer.nats_server import NatsServer
    from cache_indexer.replica import Replica

    stale = runtime_file.clean_stale_local()
    if stale:
        log.info("removed the store of a local instance that did not stop cleanly: %s", stale)
    runtime_file.simulated_targets_path().unlink(missing_ok=True)  # engines of an earlier run are gone
    server = None
    if cfg.nats.embedded:
        server = NatsServer(store_dir=cfg.nats.embeddedStoreDir or None).start()
        cfg = cfg.model_copy(update={"nats": cfg.nats.model_copy(update={"url": server.url})})
        log.info("embedded nats-server at %s (store %s)", server.url, server.store_dir)
    metrics = process_metrics(None)
    bridge = Bridge(cfg, metrics)
    replica = Replica(cfg, metrics)
    api_url = f"http://{cfg.http.host}:{cfg.http.port}"

    def _stop_server() -> None:
        if server is not None:
            if cfg.nats.embeddedStoreDir:
                server.stop()  # keep the configured store: the next start replays it
            else:
                server.close()  # a temporary store goes with the server
        runtime_file.remove_local()

    async def _announce() -> None:
        public = cfg.public()  # no secrets in the runtime file: masked, as `config show` prints them
        runtime_file.write_local({"nats_url": public["nats"]["url"], "api_url": api_url, "config": public,
                                  "targets": str(Path(cfg.discovery.static.file).resolve()),
                                  "store_dir": server.store_dir if server else "",
                                  "temporary_store": bool(server and not cfg.nats.embeddedStoreDir)})
        log.info("ready to start: API on %s; feed it with `cache-indexer simulate`", api_url)

    try:
        return await serve([_announce, bridge.start, replica.start],
                           [replica.http.stop, bridge.stop, replica.indexer.stop],
                           cfg.http.shutdownTimeout, on_second_signal=_stop_server)
    finally:
        _stop_server()  # last, after the stop steps, and also when start-up or shutdown raised


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", "-c", metavar="FILE", default=os.environ.get(CONFIG_ENV) or None,
                        help="YAML configuration file: the Helm values' shape (the chart's or the documented "
                             f"product's); default ${CONFIG_ENV}, which the chart's pods set to their mounted file")
    common.add_argument("--set", action="append", default=[], metavar="PATH=VALUE",
                        help="override one field, e.g. --set http.port=8080 (repeatable)")
    p = argparse.ArgumentParser(prog="cache-indexer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def add(name: str, summary: str, description: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], help=summary, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    local = add("local", "all-in-one local mode",
                "Runs an embedded nats-server, the bridge on a static targets file and one indexer replica\n"
                "with the API on 127.0.0.1:28080. Ctrl-C stops everything in order.")
    local.add_argument("--targets", metavar="FILE", help="static targets file (default: discovery.static.file)")
    sim = add("simulate", "simulated vLLM engines for a running local instance",
              "Starts simulated vLLM engines that publish vLLM's exact ZMQ frames (with a replay socket):\n"
              "shared system prompts, multi-turn conversations, evictions under a block budget, several\n"
              "pods and data-parallel ranks. They are added to the targets of the running `local`\n"
              "instance (or written to --targets FILE), and a ready-to-paste curl is printed once the API\n"
              "shows a non-zero L1 ratio. Ctrl-C removes them again.")
    from cache_indexer.simulate.workload import add_arguments

    add_arguments(sim)
    add("bridge", "run the bridge",
        "Discovers vLLM pods and Mooncake masters, relays their KV events into JetStream.")
    add("indexer", "run an indexer replica with the API",
        "Rebuilds the L1 and L3 indexes from the streams (snapshot + tail) and serves the hit-rate API.")
    ev = add("events", "print stream messages",
             "view, tail: print stream messages as JSON lines. The NATS server is the configured one\n"
             "(--config or $CACHE_INDEXER_CONFIG, which the chart's pods set; CACHE_INDEXER_NATS__URL; --set);\n"
             "without one, a running `cache-indexer local`. A --subject that matches nothing is an error (exit 1).\n"
             "decode: one message payload on stdin (either encoding) printed as JSON, for the nats CLI:\n"
             "  nats stream view KV_L1 --translate 'cache-indexer events decode'\n"
             "See docs/events.md.")
    ev.add_argument("mode", choices=["view", "tail", "decode"],
                    help="view: what the stream holds now; tail: follow it; decode: a payload on stdin")
    ev.add_argument("--subject", help="subject filter, e.g. 'kvcache.l1.10_0_0_1.>'")
    ev.add_argument("--last", type=int, default=0, metavar="N",
                    help="only the last N messages (of --subject where given); tail: then follow")
    ev.add_argument("--pretty", action="store_true", help="decode: indented JSON")
    ev.add_argument("--tier", choices=["l1", "l3"], default="l1", help="the L1 (vLLM) or L3 (Mooncake) stream")
    cfg = add("config", "print the effective configuration",
              "Prints the effective configuration tree as YAML: defaults < --config FILE < environment\n"
              "(CACHE_INDEXER_<SECTION>__<FIELD>) < --set.")
    cfg.add_argument("action", choices=["show"], nargs="?", default="show")
    cfg.add_argument("--local", action="store_true", help="the tree `cache-indexer local` runs with")
    return p


def local_defaults() -> dict:
    """What `local` changes from the defaults: loopback, embedded NATS, and the simulate overlay watched."""
    from cache_indexer.runtime_file import simulated_targets_path

    return {"http": {"host": "127.0.0.1"}, "nats": {"embedded": True},
            "discovery": {"static": {"extraFiles": [str(simulated_targets_path())]}}}


def _validate_static_targets(cfg: Config, required: bool) -> str | None:
    """At start-up a targets file that cannot be used is a configuration error, not an empty fleet."""
    from cache_indexer.bridge.static_targets import TargetsError, load_targets

    path = Path(cfg.discovery.static.file)
    if not path.exists():
        return f"targets file {path} not found (see examples/targets.yaml; pass --targets FILE)" if required else None
    try:
        load_targets(path)
    except (TargetsError, OSError) as exc:
        return f"targets file {exc}" if isinstance(exc, TargetsError) else f"targets file {path}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C before the event loop's handlers were installed, or in `events`
        return 130


def _main(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["events", "decode"]:
        # a filter the nats CLI runs once per message: no configuration, no connection, and none of the
        # imports the full parser brings (about 0.5 s a message)
        from cache_indexer.decode_event import main as decode_main

        return decode_main(argv[2:])
    from cache_indexer.infra.config_loader import ConfigError, load_config, log_renamed

    args = _parser().parse_args(argv)
    if args.cmd == "events" and args.last < 0:
        print("cache-indexer: --last must be 0 (everything) or more", file=sys.stderr)
        return 2
    overrides = list(args.set)
    if getattr(args, "targets", None) and args.cmd == "local":
        overrides.append(f"discovery.static.file={args.targets}")
    local_tree = args.cmd == "local" or (args.cmd == "config" and args.local)
    try:
        cfg = load_config(args.config, overrides=overrides, base=local_defaults() if local_tree else None)
    except ConfigError as exc:
        print(f"cache-indexer: {exc}", file=sys.stderr)
        return 2
    if args.cmd != "config":
        from cache_indexer.infra.nats_auth import NatsAuthError, connect_options

        try:  # the credentials and TLS files are read now: one clear line rather than endless reconnects
            connect_options(cfg.nats)
        except NatsAuthError as exc:
            print(f"cache-indexer: {exc}", file=sys.stderr)
            return 2
    setup_logging(cfg)
    log_renamed(cfg)
    if args.cmd == "config":
        import yaml

        print(yaml.safe_dump(cfg.public(), sort_keys=False), end="")
        return 0
    if args.cmd == "events":
        from cache_indexer.inspect_events import inspect

        return asyncio.run(inspect(cfg, args.mode, args.subject, args.last, tier=args.tier))
    if args.cmd == "simulate":
        from cache_indexer.simulate.workload import simulate

        return asyncio.run(simulate(cfg, args))
    if args.cmd in ("local", "bridge") and cfg.discovery.mode == "static":
        problem = _validate_static_targets(cfg, required=args.cmd == "local")
        if problem:
            print(f"cache-indexer: {problem}", file=sys.stderr)
            return 2
    if args.cmd in ("local", "indexer", "bridge"):
        busy = check_port_free(cfg.http.host, cfg.http.port)
        if busy:
            print(f"cache-indexer: {busy}; choose another with --set http.port=PORT "
                  f"(or CACHE_INDEXER_HTTP__PORT)", file=sys.stderr)
            return 2
    runner = {"bridge": run_bridge, "indexer": run_indexer, "local": run_local}[args.cmd]
    return asyncio.run(runner(cfg))


if __name__ == "__main__":
    sys.exit(main())
