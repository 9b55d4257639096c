"""vLLM-identical prefix-cache block hashing: the one implementation every component uses.

vLLM (v1) hashes block i of a request as ``H((parent, tuple(tokens[i*B:(i+1)*B]), extra_keys_i))``
with ``parent = NONE_HASH`` for block 0 and the previous block's full digest afterwards. A single
wrong byte here turns every hit ratio into a silent 0, so this module follows
vLLM's own hashing code to the letter and is tested against vectors
produced by vLLM's own code.

Blocks without extra keys (all but a salted first block, for plain requests) take a fast path: the
optional C accelerator ``schemas._blockhash`` serialises runs of blocks exactly like cbor2 / pickle and
calls the same digest function; without it the tuple header is assembled by hand around
``cbor2.dumps(tokens)``. Blocks with extra keys always go through ``cbor2`` / ``pickle`` themselves.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import cbor2
import xxhash

try:
    from cache_indexer.schemas import _blockhash
except ImportError:  # built optionally (setup.py); the pure-Python path is exact, only slower
    _blockhash = None

#: The accelerator's parser of a JSON array of token ids (bytes) into native uint64s (bytes for
#: ``array('Q').frombytes``; ValueError saying what is wrong), which the hasher reads without creating a
#: Python int per token; None without the accelerator (the caller decodes the JSON itself).
parse_token_array = _blockhash.parse_token_array if _blockhash is not None else None
#: The accelerator's ``find_token_ids(body, top_level=False) -> (start, stop) | None``: where a hit-rate
#: request's ``body.token_ids`` array lies (top_level: a /query request's ``token_ids``), found by one scan
#: of the body's structure and not parsed (None where the request is not in the plain shape: the caller
#: decodes it whole).
find_token_ids = getattr(_blockhash, "find_token_ids", None)

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
ExtraKeysEncoding = Literal["tagged", "untagged"]

HASH_ALGOS: tuple[str, ...] = ("sha256_cbor", "sha256", "xxhash", "xxhash_cbor")
#: vLLM >= 0.29 hashes this string when PYTHONHASHSEED is unset and the algorithm is sha256*.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
U64_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class LoRAKey:
    """The LoRA adapter of a request: vLLM >= 0.31 hashes name and path, 0.11.1-0.30 the name only."""

    name: str
    path: str = ""


@dataclass(frozen=True)
class MultiModalKey:
    """A multimodal placeholder: its identifier (mm hash) and token span [offset, offset+length)."""

    identifier: str
    offset: int
    length: int


def event_block_hash(digest: bytes) -> int:
    """The integer form vLLM publishes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): last 8 bytes, big-endian."""
    return int.from_bytes(digest[-8:], "big")


def normalize_event_hash(value: int | bytes) -> int:
    """Canonical uint64 of a hash as found in events: ints (also negative, builtin-hash era) or raw bytes."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return int.from_bytes(bytes(value)[-8:], "big")
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"block hash must be int or bytes, got {type(value).__name__}")
    return value & U64_MASK


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class BlockHasher:
    """Computes a request's block-hash chain exactly as a vLLM engine configured the same way.

    ``python_hash_seed`` mirrors the engine's ``$PYTHONHASHSEED`` (None = unset). ``extra_keys_encoding``
    selects vLLM >= 0.31 tagged extra keys or the bare values of 0.11.1-0.30.
    """

    def __init__(
        self,
        algo: HashAlgo = "sha256_cbor",
        python_hash_seed: str | None = None,
        extra_keys_encoding: ExtraKeysEncoding = "tagged",
        accelerate: bool = True,
    ) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash algorithm {algo!r}; expected one of {', '.join(HASH_ALGOS)}")
        if extra_keys_encoding not in ("tagged", "untagged"):
            raise ValueError(f"unknown extra keys encoding {extra_keys_encoding!r}")
        if python_hash_seed is None and algo.startswith("xxhash"):
            raise ValueError(
                f"{algo} needs python_hash_seed: with PYTHONHASHSEED unset vLLM seeds NONE_HASH randomly per "
                "process, so no external index can reproduce its hashes"
            )
        self.algo = algo
        self.python_hash_seed = python_hash_seed
        self.extra_keys_encoding = extra_keys_encoding
        self._cbor = algo.endswith("_cbor")
        self._sha = algo.startswith("sha256")
        self._accel = _blockhash if accelerate else None
        self._digest = _sha256_digest if self._sha else xxhash.xxh3_128_digest
        seed = python_hash_seed if python_hash_seed is not None else DEFAULT_NONE_HASH_SEED
        self.none_hash: bytes = self.hash_object(seed)

    @classmethod
    def for_block_key(cls, block_key) -> "BlockHasher":
        """The hasher of a ``blockKey`` configuration section (schemas.config.BlockKeyConfig)."""
        return cls(block_key.hashAlgo, block_key.pythonHashSeed, block_key.extraKeysEncoding)

    # -- primitive ---------------------------------------------------------------------------------
    def serialize(self, obj: object) -> bytes:
        """The exact bytes vLLM feeds to the digest for ``obj``."""
        if self._cbor:
            return cbor2.dumps(obj, canonical=True)
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    def hash_object(self, obj: object) -> bytes:
        return self._digest(self.serialize(obj))

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple | None = None) -> bytes:
        """``hash_block_tokens``: one block given its parent digest (None for the first block)."""
        return self.hash_object((parent or self.none_hash, tuple(tokens), extra_keys))

    # -- extra keys ------------------------------------------------------------------------------
    def block_extra_keys(
        self,
        start: int,
        end: int,
        cache_salt: str | None = None,
        lora: LoRAKey | None = None,
        mm_features: Sequence[MultiModalKey] = (),
    ) -> tuple | None:
        """``generate_block_hash_extra_keys`` for tokens [start, end): LoRA, MM, salt (first block only)."""
        tagged = self.extra_keys_encoding == "tagged"
        keys: list = []
        if lora is not None:
            keys.append(("lora", lora.name, lora.path) if tagged else lora.name)
        for mm in mm_features:
            if mm.offset < end and mm.offset + mm.length > start:
                rel = mm.offset - start
                keys.append(("mm", mm.identifier, rel) if tagged else (mm.identifier, rel))
        if start == 0 and cache_salt:
            keys.append(("cache_salt", cache_salt) if tagged else cache_salt)
        return tuple(keys) if keys else None

    # -- chains ---------------------------------------------------------------------------------
    def iter_block_hashes(self, token_ids: Sequence[int], block_size: int, **kwargs) -> Iterator[bytes]:
        """Lazily yields the digests of the request's full blocks, in order (keywords as
        iter_block_hash_chunks). Stop iterating as soon as no further block can matter: nothing after
        the first miss is computed, beyond the chunk it is in."""
        for chunk in self.iter_block_hash_chunks(token_ids, block_size, **kwargs):
            yield from chunk

    def iter_block_hash_chunks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        cache_salt: str | None = None,
        lora: LoRAKey | None = None,
        mm_features: Sequence[MultiModalKey] = (),
        lookahead_tokens: int = 0,
    ) -> Iterator[list[bytes]]:
        """The digests of the request's full blocks in order, a list at a time: as the C accelerator
        computes them (runs growing from 8 to 512 blocks), else one by one."""
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        n_blocks = (len(token_ids) - lookahead_tokens) // block_size if lookahead_tokens else len(token_ids) // block_size
        if n_blocks <= 0:
            return
        if lora is None and not mm_features and not lookahead_tokens:
            yield from self._iter_plain(token_ids, block_size, n_blocks, cache_salt)
            return
        parent = self.none_hash
        for i in range(n_blocks):
            start, end = i * block_size, (i + 1) * block_size
            extra = self.block_extra_keys(start, end + lookahead_tokens, cache_salt, lora, mm_features)
            if lookahead_tokens:
                extra = (extra, *token_ids[end : end + lookahead_tokens])
                if lookahead_tokens == 1:
                    extra = (extra[0], extra[1])
            parent = self.hash_object((parent, tuple(token_ids[start:end]), extra))
            yield [parent]

    def _iter_plain(self, token_ids: Sequence[int], block_size: int, n_blocks: int,
                    cache_salt: str | None) -> Iterator[list[bytes]]:
        """The hot path: no LoRA/MM/lookahead, salt only on block 0."""
        parent = self.none_hash
        start = 0
        if cache_salt:
            parent = self.hash_block(parent, token_ids[0:block_size], self.block_extra_keys(0, block_size, cache_salt))
            yield [parent]
            start = 1
        if self._accel is not None and start < n_blocks and (self._cbor or block_size <= PICKLE_ONE_FRAME_TOKENS):
            if isinstance(token_ids, memoryview) and token_ids.format == "Q":
                token_ids = array("Q", token_ids.tobytes())
            if not isinstance(token_ids, (list, tuple)) and not (isinstance(token_ids, array) and token_ids.typecode == "Q"):
                token_ids = list(token_ids)
            digest_fn, sha_mode = (hashlib.sha256, True) if self._sha else (self._digest, False)
            chunk = 8  # grows, so an early stop stays cheap and a long chain amortises the call
            while start < n_blocks:
                n = min(chunk, n_blocks - start)
                try:
                    digests = self._accel.chain(parent, token_ids, block_size, start, n, self._cbor, digest_fn, sha_mode)
                except (OverflowError, TypeError):
                    break  # a token the C encoder does not take (huge or not an int): Python path below
                yield digests
                parent = digests[-1]
                start += n
                chunk = min(chunk * 2, 512)
            if start >= n_blocks:
                return
        for digest in self._iter_python(token_ids, block_size, start, n_blocks, parent):
            yield [digest]

    def _iter_python(self, token_ids: Sequence[int], block_size: int, start: int, n_blocks: int,
                     parent: bytes) -> Iterator[bytes]:
        if isinstance(token_ids, array):
            token_ids = token_ids.tolist()  # cbor2 encodes lists, not arrays
        if not self._cbor:
            dumps, proto = pickle.dumps, pickle.HIGHEST_PROTOCOL
            digest = self._digest
            for i in range(start, n_blocks):
                parent = digest(dumps((parent, tuple(token_ids[i * block_size : (i + 1) * block_size]), None), proto))
                yield parent
            return
        # CBOR of the 3-tuple (parent, tokens, None): array(3) + bytes(len) + parent + array(tokens) + null.
        head = b"\x83" + _cbor_bytes_head(len(parent))
        dumps = cbor2.dumps
        if self._sha:
            sha256 = hashlib.sha256
            for i in range(start, n_blocks):
                parent = sha256(head + parent + dumps(token_ids[i * block_size : (i + 1) * block_size]) + b"\xf6").digest()
                yield parent
        else:
            xx = self._digest
            for i in range(start, n_blocks):
                parent = xx(head + parent + dumps(token_ids[i * block_size : (i + 1) * block_size]) + b"\xf6")
                yield parent

    def block_hashes(self, token_ids: Sequence[int], block_size: int, **kwargs) -> list[bytes]:
        return list(self.iter_block_hashes(token_ids, block_size, **kwargs))

    def event_hashes(self, token_ids: Sequence[int], block_size: int, **kwargs) -> list[int]:
        """The chain in the integer form vLLM puts in KV events (and the index keys on)."""
        return [event_block_hash(d) for d in self.iter_block_hashes(token_ids, block_size, **kwargs)]


#: The C encoder writes a pickle as one frame; CPython starts a new frame past 64 KiB. A token takes at
#: most 11 bytes (LONG1 of a uint64), so blocks up to this many tokens always fit one frame; larger
#: blocks (rare: vLLM's block sizes are 16 - 256) take pickle.dumps itself.
PICKLE_ONE_FRAME_TOKENS = (65536 - 256) // 11


def _cbor_bytes_head(n: int) -> bytes:
    """CBOR major type 2 (byte string) header for length n."""
    if n < 24:
        return bytes([0x40 + n])
    if n < 256:
        return bytes([0x58, n])
    return b"\x59" + n.to_bytes(2, "big")
