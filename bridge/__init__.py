"""The bridge: the sources' side. Discovers vLLM pods and Mooncake masters (Kubernetes labels or a
static file), reads vLLM's ZMQ KV events (sequencing, replay, resume points) and polls the masters, and
publishes normalized events on the NATS streams (``schemas.events``).

May import: ``schemas``, ``infra``. Never ``indexer`` (the two meet only on the streams' contract),
``api`` or the program. A new event source goes here, as a module publishing ``schemas.events``
messages through ``jetstream_publisher``.
"""
