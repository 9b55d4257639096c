"""A Mooncake master's admin API (the >= 0.3.12 formats, tests/test_mooncake.py's FakeMaster) in its own
process, so that its CPU is not counted as the bridge's. Serves ``--keys`` keys on 8 segments and, every
``--churn-every`` seconds, replaces ``--churn`` of them (removed and new keys). Prints ``URL <url>``."""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from tests.test_mooncake import FakeMaster, key


class CachedListingMaster(FakeMaster):
    """The listing is built once per change, as a real master's C++ handler costs little next to ours."""

    body = b""

    def changed(self) -> None:
        self.body = "".join(k + "\n" for k in self.keys).encode()

    async def all_keys(self, request):
        return web.Response(body=self.body, content_type="text/plain")


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, required=True)
    ap.add_argument("--churn", type=float, default=0.01)
    ap.add_argument("--churn-every", type=float, default=2.0)
    args = ap.parse_args()
    master = await CachedListingMaster().start()
    master.segments = [f"127.0.3.{i}:12000" for i in range(1, 9)]
    master.keys = {key(i, tp=i % 2): [f"127.0.3.{i % 8 + 1}:16000"] for i in range(args.keys)}
    master.changed()
    print(f"URL {master.url}", flush=True)
    oldest, nxt, step = 0, args.keys, max(1, int(args.keys * args.churn))
    while True:
        await asyncio.sleep(args.churn_every)
        for i in range(oldest, oldest + step):
            master.keys.pop(key(i, tp=i % 2), None)
        for i in range(nxt, nxt + step):
            master.keys[key(i, tp=i % 2)] = [f"127.0.3.{i % 8 + 1}:16000"]
        oldest, nxt = oldest + step, nxt + step
        master.changed()


if __name__ == "__main__":
    asyncio.run(main())
