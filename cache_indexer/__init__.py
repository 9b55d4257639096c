"""The program, on top: the ``cache-indexer`` command (``cli``), a replica (indexer + API,
``replica``), local mode's embedded nats-server (``nats_server``, ``runtime_file``), the events CLI
(``inspect_events``) and ``simulate`` (fake vLLM engines, which only it and the tests run).

May import: every package of the product. Nothing of the product imports it.
"""

from infra.version import VERSION as __version__

__all__ = ["__version__"]
