"""The contracts, the bottom layer: what crosses a process or a product boundary.

- ``events``: the normalized L1/L3 messages on the NATS streams (headers, payloads, bounds);
- ``api``: the hit-rate request and response (the OpenAPI document is generated from it);
- ``config`` and ``helm_values``: the configuration tree, which mirrors the Helm chart's values;
- ``block_hash``: vLLM's prefix-cache block hash, the contract between vLLM's events, Mooncake's keys
  and the query (one wrong byte and every ratio is 0), with its optional C accelerator.

May import: nothing of the product (third-party libraries only). Everything else may import it.
"""
