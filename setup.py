"""Builds the optional C accelerators (the block hasher's, the hit-rate walk's, the bridge's bulk ZMQ
receive and its decoder of vLLM's current batches); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and the pure-Python path is used.
On Linux they link libdl to find libcrypto and libzmq at run time (glibc >= 2.34 has dlopen in libc anyway).
"""

import sys

from setuptools import Extension, setup

_dl = ["dl"] if sys.platform.startswith("linux") else []
setup(ext_modules=[Extension("schemas._blockhash", ["schemas/_blockhash.c"], optional=True,
                             depends=["schemas/_blockhash_core.h"],
                             extra_compile_args=["-O3"], libraries=_dl),
                   Extension("indexer._prefix_walk", ["indexer/_prefix_walk.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   Extension("indexer._native_index", ["indexer/_native_index.c"], optional=True,
                             depends=["indexer/native_table.h", "indexer/native_pool.h", "schemas/_blockhash_core.h"],
                             extra_compile_args=["-O3"], libraries=[*_dl, "pthread"]),
                   Extension("bridge._zmq_drain", ["bridge/_zmq_drain.c"], optional=True,
                             extra_compile_args=["-O3"], libraries=_dl),
                   Extension("bridge._vllm_decode", ["bridge/_vllm_decode.c"], optional=True,
                             extra_compile_args=["-O3"])])
