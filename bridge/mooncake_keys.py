"""The block hash inside Mooncake Store keys written by vLLM-side connectors.

Every supported grammar carries vLLM's ``BlockHash.hex()`` (64 hex digits for sha256*, 32 for
xxhash*) as one ``@``-separated field; its last 16 hex digits are the integer form vLLM puts in KV
events, so L1 and L3 are addressed by the same hash chain. Grammars (../shared/reference/mooncake,
REPORT section 6) are tried most specific first. vllm-ascend 0.11 keys and LMCache keys carry other
hashes (a rolling hash of their own, LMCache's chunk hash): they are recognised and skipped, and keys
matching no grammar are counted as unmatched.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

HEX = r"(?P<hash>[0-9a-f]{32}|[0-9a-f]{64})"

#: name -> regex with a named group ``hash``; order matters (specific before loose).
KEY_FORMATS: dict[str, str] = {
    "ascend_v2": r"^(?P<model>[^@]+)@pcp\d+@dcp\d+@head_or_tp_rank:\d+@pp_rank:\d+@group:\d+@cache_role:[^@]+@cache_family:[^@]+@" + HEX + r"$",
    "ascend_v2_layer": r"^(?P<model>[^@]+)@pcp\d+@dcp\d+@head_or_tp_rank:\d+@group:\d+@cache_role:[^@]+@cache_family:[^@]+@layer_id:\d+@" + HEX + r"$",
    "ascend_v2_layer_v020": r"^(?P<model>[^@]+)@pcp\d+@dcp\d+@head_or_tp_rank:\d+@group:\d+@cache_role:[^@]+@cache_family:[^@]+@" + HEX + r"@\d+$",
    "ascend_v1": r"^(?P<model>[^@]+)@pcp\d+@dcp\d+@head_or_tp_rank:\d+@pp_rank:\d+@" + HEX + r"$",
    "ascend_v1_layer": r"^(?P<model>[^@]+)@pcp\d+@dcp\d+@head_or_tp_rank:\d+@" + HEX + r"@\d+$",
    "vllm_store_v2": r"^(?:[^@]+@)?(?P<model>[^@]+)@tp_rank:\d+@pcp\d+@dcp\d+@pp_rank:\d+@group:\d+@" + HEX + r"$",
    "vllm_store_v1": r"^(?P<model>[^@]+)@tp_rank:\d+@pcp\d+@dcp\d+@pp_rank:\d+@" + HEX + r"(?:@grp:\d+)?$",
}
#: Grammars that carry no vLLM block hash: recognised so they are not reported as malformed.
FOREIGN_FORMATS: dict[str, str] = {
    "ascend_v0_11": r"^(?P<model>[^@]+)@\d+@\d+@[0-9a-f]{64}(?:@\d+)?$",
    "lmcache": r"^[^@]+@[^@]+@\d+@\d+@-?[0-9a-f]+(?:@[^@]+)*$",
}
DEFAULT_FORMATS = list(KEY_FORMATS)


class KeyParser:
    def __init__(self, formats: Iterable[str] = DEFAULT_FORMATS, extra_patterns: Iterable[str] = ()) -> None:
        unknown = [f for f in formats if f not in KEY_FORMATS]
        if unknown:
            raise ValueError(f"unknown Mooncake key formats {unknown}; known: {', '.join(KEY_FORMATS)}")
        self._patterns = [re.compile(p) for p in extra_patterns] + [re.compile(KEY_FORMATS[f]) for f in formats]
        for p in self._patterns:
            if "hash" not in p.groupindex:
                raise ValueError(f"key pattern {p.pattern!r} has no named group 'hash'")
        self._foreign = [re.compile(p) for p in FOREIGN_FORMATS.values()]
        self.unmatched = 0
        self.foreign = 0

    def block_hash(self, key: str) -> int | None:
        """The uint64 block hash of a key, or None (counted) when it carries none we can use."""
        for p in self._patterns:
            m = p.match(key)
            if m:
                return int(m.group("hash")[-16:], 16)
        if any(p.match(key) for p in self._foreign):
            self.foreign += 1
        else:
            self.unmatched += 1
        return None
