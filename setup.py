"""Builds the optional C accelerators (the block hasher's, the hit-rate walk's, the bridge's bulk ZMQ
receive and its decoder of vLLM's current batches, the indexer's reader of stream payloads, the seed API's
answer); everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and the pure-Python path is used.
Their import names are under ``cache_indexer`` (the one top-level package) while their sources stay in
the repository's folders; pyproject.toml's package-dir maps one to the other, so ``build_ext --inplace``
puts each next to its source (indexer/_native_index.*.so). On Linux they link libdl to find libcrypto
and libzmq at run time (glibc >= 2.34 has dlopen in libc anyway).
"""

import sys

from setuptools import Extension, setup

_dl = ["dl"] if sys.platform.startswith("linux") else []
setup(ext_modules=[Extension("cache_indexer.schemas._blockhash", ["schemas/_blockhash.c"], optional=True,
                             depends=["schemas/_blockhash_core.h"],
                             extra_compile_args=["-O3"], libraries=_dl),
                   Extension("cache_indexer.indexer._prefix_walk", ["indexer/_prefix_walk.c"], optional=True,
                             extra_compile_args=["-O3"]),
                   Extension("cache_indexer.indexer._native_index", ["indexer/_native_index.c"], optional=True,
                             depends=["indexer/native_table.h", "indexer/native_pool.h", "schemas/_blockhash_core.h"],
                             extra_compile_args=["-O3"], libraries=[*_dl, "pthread"]),
                   Extension("cache_indexer.bridge._zmq_drain", ["bridge/_zmq_drain.c"], optional=True,
                             extra_compile_args=["-O3"], libraries=_dl),
                   Extension("cache_indexer.bridge._vllm_decode", ["bridge/_vllm_decode.c"], optional=True,
                             depends=["infra/msgpack_read.h"], extra_compile_args=["-O3"]),
                   Extension("cache_indexer.infra._event_unpack", ["infra/_event_unpack.c"], optional=True,
                             depends=["infra/msgpack_read.h"], extra_compile_args=["-O3"]),
                   Extension("cache_indexer.api._answer_json", ["api/_answer_json.c"], optional=True,
                             extra_compile_args=["-O3"])])
