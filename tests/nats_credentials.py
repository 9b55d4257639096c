"""NATS credentials made for tests: nkeys, and an operator/account/user JWT chain with a .creds file,
signed with the ``nkeys`` library the client itself uses (what ``nsc`` would produce, offline).

JWT v2 layout: header ``{"typ":"JWT","alg":"ed25519-nkey"}``, claims with ``iss`` (signer's public
key), ``sub`` (the subject's public key) and ``nats`` (type, version 2, limits), base64url without
padding, signed with ed25519 over ``header.claims``.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import nkeys


def new_key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(bytearray(nkeys.encode_seed(os.urandom(32), prefix)))


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _jwt(signer: nkeys.KeyPair, subject: str, name: str, nats: dict) -> str:
    claims = {"jti": base64.b32encode(os.urandom(20)).decode().rstrip("="), "iat": int(time.time()),
              "iss": signer.public_key.decode(), "name": name, "sub": subject, "nats": {**nats, "version": 2}}
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims).encode())
    return f"{head}.{body}.{_b64(signer.sign(f'{head}.{body}'.encode()))}"


UNLIMITED = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True, "conn": -1,
             "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}


def operator_setup(tmp: Path) -> tuple[str, Path]:
    """(server configuration in operator mode with a JetStream-enabled account, path of a user's .creds)."""
    operator = new_key(nkeys.PREFIX_BYTE_OPERATOR)
    account = new_key(nkeys.PREFIX_BYTE_ACCOUNT)
    user = new_key(nkeys.PREFIX_BYTE_USER)
    op_jwt = _jwt(operator, operator.public_key.decode(), "test-operator", {"type": "operator"})
    acc_pub = account.public_key.decode()
    acc_jwt = _jwt(operator, acc_pub, "cache-indexer", {"type": "account", "limits": UNLIMITED})
    user_jwt = _jwt(account, user.public_key.decode(), "bridge",
                    {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1})
    creds = tmp / "user.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n")
    system = new_key(nkeys.PREFIX_BYTE_ACCOUNT)  # JetStream needs the server's system account
    sys_pub = system.public_key.decode()
    sys_jwt = _jwt(operator, sys_pub, "SYS", {"type": "account", "limits": {**UNLIMITED, "mem_storage": 0,
                                                                           "disk_storage": 0, "streams": 0,
                                                                           "consumer": 0}})
    conf = (f"operator: {op_jwt}\nsystem_account: {sys_pub}\nresolver: MEMORY\n"
            f"resolver_preload: {{ {acc_pub}: {acc_jwt}, {sys_pub}: {sys_jwt} }}\n")
    return conf, creds
