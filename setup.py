"""Builds the optional C accelerator of the block hasher; everything else is in pyproject.toml.

``optional=True``: without a C compiler the install still succeeds and the pure-Python path is used.
On Linux it links libdl to find libcrypto at run time (glibc >= 2.34 has dlopen in libc anyway).
"""

import sys

from setuptools import Extension, setup

setup(ext_modules=[Extension("indexer._blockhash", ["indexer/_blockhash.c"], optional=True,
                             extra_compile_args=["-O3"],
                             libraries=["dl"] if sys.platform.startswith("linux") else [])])
