"""What nats-py needs to authenticate and encrypt, from ``nats.*``: one kind of credentials (user and
password, token, nkey seed file, .creds file) and TLS with a private CA and a client certificate.

Files are read here, at start-up, so a missing or unreadable one is one clear error naming the setting
rather than a connection that retries for ever.
"""

from __future__ import annotations

import os
import ssl

from cache_indexer.schemas.config import NatsConfig


class NatsAuthError(ValueError):
    pass


def _readable(setting: str, path: str) -> str:
    if not os.access(path, os.R_OK):
        raise NatsAuthError(f"nats.{setting}: cannot read {path!r}")
    return path


def tls_context(cfg: NatsConfig) -> ssl.SSLContext | None:
    from cache_indexer.infra.streams import servers  # (streams builds its connections with this module)

    tls = cfg.tls
    if not (tls.on or any(u.startswith("tls://") for u in servers(cfg.url))):
        return None
    try:
        ctx = ssl.create_default_context(cafile=_readable("tls.caFile", tls.caFile) if tls.caFile else None)
        if tls.certFile:
            ctx.load_cert_chain(_readable("tls.certFile", tls.certFile), _readable("tls.keyFile", tls.keyFile))
    except ssl.SSLError as exc:
        raise NatsAuthError(f"nats.tls: cannot use the CA or client certificate: {exc}") from None
    return ctx


def connect_options(cfg: NatsConfig) -> dict:
    """Keyword arguments of ``nats.connect`` for the credentials and TLS of ``cfg``."""
    opts: dict = {}
    if cfg.user:
        opts.update(user=cfg.user, password=cfg.password.get_secret_value())
    elif cfg.token.get_secret_value():
        opts["token"] = cfg.token.get_secret_value()
    elif cfg.nkeySeedFile:
        opts["nkeys_seed"] = _readable("nkeySeedFile", cfg.nkeySeedFile)
    elif cfg.credsFile:
        opts["user_credentials"] = _readable("credsFile", cfg.credsFile)
    ctx = tls_context(cfg)
    if ctx is not None:
        opts["tls"] = ctx
        if cfg.tls.serverName:
            opts["tls_hostname"] = cfg.tls.serverName
    return opts
