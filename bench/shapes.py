"""Query shapes of the benchmarks (issue targets) and their deterministic token sequences."""

from __future__ import annotations

import random

SHAPES = [
    {"name": "32k tokens x 16 candidates, bs 16", "tokens": 32768, "candidates": 16, "block_size": 16, "target_p99_ms": 10},
    {"name": "32k tokens x 16 candidates, bs 128", "tokens": 32768, "candidates": 16, "block_size": 128, "target_p99_ms": 5},
    {"name": "240k tokens x 96 candidates, bs 64", "tokens": 240_000, "candidates": 96, "block_size": 64, "target_p99_ms": 20},
    {"name": "240k tokens x 96 candidates, bs 16", "tokens": 240_000, "candidates": 96, "block_size": 16, "target_p99_ms": None},
]


def tokens_for(shape: dict) -> list[int]:
    rng = random.Random(shape["tokens"] * 1000 + shape["block_size"])
    return [rng.randrange(0, 151_000) for _ in range(shape["tokens"])]


def pods(n: int) -> list[str]:
    return [f"127.1.{i // 250}.{i % 250 + 1}" for i in range(n)]
