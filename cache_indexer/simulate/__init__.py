"""``cache-indexer simulate``: fake vLLM engines speaking vLLM's exact ZMQ frames (``vllm_engine``) and
the workload that drives them against a running instance (``workload``). The benchmarks and tests use
the same engine.

May import: every package of the product (it is part of the program).
"""
