"""The HTTP API above the indexer: ``POST /kv-cache/hit-rate`` (``app``), its fast request decoding
(``hit_rate_request``), the guard on header and body sizes (``header_guard``), the probes and metrics
(``ops``) and the server (``server``).

May import: ``schemas``, ``infra``, ``indexer``. Never ``bridge`` or the program. A new endpoint
goes here, its request and response models in ``schemas.api``.
"""
