"""The shared ground every process stands on, above the contracts.

NATS connections and streams (``streams``), the streams' payload encodings (``event_codec``),
authentication and TLS (``nats_auth``), leader leases in a KV bucket (``lease``), task helpers
(``tasks``), Prometheus metrics (``metrics``), throttled warnings (``throttled_log``), long work on the
event loop in pieces (``pauser``), and configuration loading from file, environment and flags
(``config_loader``).

May import: ``schemas``. Imported by ``bridge``, ``indexer``, ``api`` and the program; it knows
nothing of them.
"""
