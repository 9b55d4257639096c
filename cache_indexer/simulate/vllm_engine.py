"""A vLLM KV-event publisher speaking vLLM's exact ZMQ frames (ZmqEventPublisher, 0.33): the engine side
of ``cache-indexer simulate``, of the benchmarks and of the tests (one implementation for all three).

- live: ``[topic, seq (8-byte big-endian), msgpack KVEventBatch]`` on a PUB-compatible socket (XPUB,
  so a caller can wait until the bridge has subscribed instead of sleeping);
- replay: a ROUTER that answers ``[client, b"", start_seq]`` with ``[client, b"", topic, seq, payload]``
  per buffered batch with seq >= start, then ``[client, b"", b"", END_SEQ, b""]``; ``legacy_replay``
  drops the topic frame as vLLM < 0.26 did;
- payloads: map-shaped events as vLLM >= 0.24 encodes them, or raw bytes (e.g. vLLM's own payloads).
Helpers can skip live sends (to make gaps), restart the engine (seq back to 0) and bound the buffer.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgpack
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list[int], parent: int | None = None, medium: str | None = "GPU", block_size: int = 16,
           lora_name: str | None = None, group_idx: int = 0, spec_kind: str = "full_attention",
           token_ids: list[int] | None = None) -> dict:
    """A BlockStored; without ``token_ids`` the tokens are placeholders that do not hash to ``hashes``."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(token_ids) if token_ids is not None else list(range(block_size * len(hashes))),
            "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": lora_name, "extra_keys": [None] * len(hashes), "group_idx": group_idx,
            "kv_cache_spec_kind": spec_kind}


def removed(hashes: list[int], medium: str | None = "GPU", group_idx: int = 0) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": group_idx}


def cleared() -> dict:
    return {"type": "AllBlocksCleared"}


def batch_payload(events: list[dict], dp_rank: int = 0, ts: float | None = None) -> bytes:
    return msgpack.packb([ts if ts is not None else time.time(), events, dp_rank], use_bin_type=True)


class VllmPublisher:
    def __init__(self, ctx: zmq.asyncio.Context, host: str, pub_port: int, replay_port: int | None = None,
                 topic: str = "", dp_rank: int = 0, buffer_steps: int = 10000, legacy_replay: bool = False,
                 replay_hwm: int = 1000, replay_sndbuf: int = 0, replay_cut: int | None = None) -> None:
        self.ctx = ctx
        self.host = host
        self.topic = topic.encode()
        self.dp_rank = dp_rank
        self.legacy_replay = legacy_replay
        #: answer at most this many batches per replay request, without the end marker, as a ROUTER past
        #: its send high-water mark does (deterministically, where the socket's drops depend on timing)
        self.replay_cut = replay_cut
        #: the next this many replay requests get no answer at all (an engine too busy to answer in time)
        self.replay_deaf = 0
        #: the next answers lose their last this many batches each (one count an answer, in order) but not
        #: their end marker: a ROUTER whose pipe was full at those (past its send high-water mark) and had
        #: room again when the marker came
        self.replay_tail_lost: list[int] = []
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        #: batches published since this object was made, across engine restarts (tests wait on it)
        self.batches = 0
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # every subscription reaches wait_subscribed, also one for a topic an old, still closing SUB
        # holds (a resubscription would otherwise be swallowed as a duplicate)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.SNDHWM, 100000)
        if pub_port:
            self.pub.bind(f"tcp://{host}:{pub_port}")
        else:
            pub_port = self.pub.bind_to_random_port(f"tcp://{host}")
        self.pub_port = pub_port
        self.replay_port = replay_port
        self.router = None
        self._replay_task = None
        self.replay_requests: list[int] = []
        self.subscribers = 0
        if replay_port is not None:  # 0: a random port
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            # libzmq's default before vLLM 0.33 (2*(buffer_steps+1) since): past it a ROUTER drops silently
            self.router.setsockopt(zmq.SNDHWM, replay_hwm)
            if replay_sndbuf:  # the kernel's send buffer (0: the OS default)
                self.router.setsockopt(zmq.SNDBUF, replay_sndbuf)
            if replay_port > 0:
                self.router.bind(f"tcp://{host}:{replay_port}")
            else:
                self.replay_port = self.router.bind_to_random_port(f"tcp://{host}")
            self._replay_task = asyncio.create_task(self._serve_replay())

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        """Wait for a subscription message on the XPUB socket (the bridge's SUB has joined)."""
        async def _recv() -> None:
            while True:
                msg = await self.pub.recv()
                if msg[:1] == b"\x01":
                    self.subscribers += 1
                    return
        await asyncio.wait_for(_recv(), timeout)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests.append(start)
            if self.replay_deaf > 0:
                self.replay_deaf -= 1
                continue
            held = [(seq, payload) for seq, payload in self.buffer if seq >= start]
            cut = self.replay_cut is not None and len(held) >= self.replay_cut
            if cut:
                held = held[:self.replay_cut]
            elif self.replay_tail_lost:
                # (the first batch always comes: the pipe to a new request is empty)
                held = held[:max(1, len(held) - self.replay_tail_lost.pop(0))]
            for seq, payload in held:
                body = [seq.to_bytes(8, "big"), payload] if self.legacy_replay else [self.topic, seq.to_bytes(8, "big"), payload]
                await self.router.send_multipart([client, b"", *body])
            if cut:
                continue
            end = [END_SEQ, b""] if self.legacy_replay else [b"", END_SEQ, b""]
            await self.router.send_multipart([client, b"", *end])

    def endpoint(self, pod: str | None = None, rank: int = 0):
        from cache_indexer.bridge.endpoint import Endpoint

        return Endpoint(pod=pod or self.host, rank=rank, pub=f"tcp://{self.host}:{self.pub_port}",
                        replay=f"tcp://{self.host}:{self.replay_port}" if self.router is not None else None)

    async def publish_payload(self, payload: bytes, send: bool = True) -> int:
        """Buffer the batch under the next seq; send it live unless ``send`` is False (a lost message)."""
        seq = self.seq
        self.seq += 1
        self.batches += 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def publish(self, events: list[dict], send: bool = True) -> int:
        return await self.publish_payload(batch_payload(events, self.dp_rank), send)

    def restart_engine(self) -> None:
        """What a restarted vLLM engine looks like: seq from 0 again and an empty replay buffer."""
        self.seq = 0
        self.buffer.clear()

    async def restart_process(self) -> None:
        """A restarted engine process: new sockets bound to the same ports (subscribers reconnect)."""
        self.restart_engine()
        await self.go_away()
        self.come_back()

    async def go_away(self) -> None:
        """The engine unreachable (its sockets closed: a network partition, a pod being moved), its seq and
        buffer kept; ``come_back`` binds the same ports again."""
        if self._replay_task:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)

    def come_back(self) -> None:
        self.pub = self._bind(zmq.XPUB, self.pub_port)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        if self.router is not None:
            self.router = self._bind(zmq.ROUTER, self.replay_port)
            self._replay_task = asyncio.create_task(self._serve_replay())

    def _bind(self, kind: int, port: int):
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for _ in range(100):  # the old socket's port is released asynchronously by ZMQ's I/O thread
            try:
                sock.bind(f"tcp://{self.host}:{port}")
                return sock
            except zmq.ZMQError:
                time.sleep(0.01)
        sock.bind(f"tcp://{self.host}:{port}")
        return sock

    async def close(self) -> None:
        if self._replay_task:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
