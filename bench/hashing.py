"""Hashing a request's full block chain: time vs hashlib's sha256 over the same serialized bytes.

The floor is what any implementation must pay: one sha256 per block over exactly the bytes vLLM hashes
(precomputed here). The ratio says how much the serialisation costs on top.
"""

from __future__ import annotations

import hashlib
import random

from bench.common import summary, timeit
from cache_indexer.schemas.block_hash import BlockHasher


def _inputs(h: BlockHasher, tokens: list[int], bs: int) -> list[bytes]:
    out, parent = [], h.none_hash
    for i in range(len(tokens) // bs):
        data = h.serialize((parent, tuple(tokens[i * bs:(i + 1) * bs]), None))
        out.append(data)
        parent = hashlib.sha256(data).digest()
    return out


def run(quick: bool = False) -> list[dict]:
    rng = random.Random(7)
    rows = []
    for algo in ("sha256_cbor", "sha256"):
        h = BlockHasher(algo, "0")
        for n_tokens in (32768, 131072):
            tokens = [rng.randrange(0, 151_000) for _ in range(n_tokens)]
            for bs in (16, 128):
                inputs = _inputs(h, tokens, bs)
                sha = hashlib.sha256

                def floor() -> None:
                    for b in inputs:
                        sha(b).digest()

                def ours() -> None:
                    for _ in h.iter_block_hashes(tokens, bs):
                        pass

                rep = 5 if quick else (20 if n_tokens > 40000 else 40)
                f, o = summary(timeit(floor, rep)), summary(timeit(ours, rep))
                rows.append({"algo": algo, "tokens": n_tokens, "block_size": bs, "blocks": len(inputs),
                             "ours_median": o["median"], "ours_p99": o["p99"], "floor_median": f["median"],
                             "ratio": o["median"] / f["median"]})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| algo | tokens | block size | blocks | ours median | ours p99 | hashlib floor median | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['algo']} | {r['tokens']} | {r['block_size']} | {r['blocks']} | {r['ours_median']*1e3:.2f} ms "
                     f"| {r['ours_p99']*1e3:.2f} ms | {r['floor_median']*1e3:.2f} ms | {r['ratio']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(run()))
