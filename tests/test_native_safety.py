"""Issue 26: the native code trusted with the network's bytes, each finding of the review a test that
failed before its fix. The crashing ones run in a child process: a use-after-free or an endless loop
there is a failed assertion here, not a dead test run.

1. ``chain()`` kept borrowed item pointers of a list while Python ran (``__index__``, the digest
   function), which may resize the list: a use-after-free.
2. Signed overflow in its bounds check: ``(first + n) * bs`` wrapped, and ``bs = 2**61`` looped for ever.
3. ``True``/``False`` hashed as 1/0, where cbor2 and pickle encode booleans.
4. ``bridge/_zmq_drain.c`` bound whichever single libzmq was mapped into the process, not necessarily
   pyzmq's.
5. A failed bulk receive threw away the messages already received and could leave half a multipart
   message to be read as a malformed one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import zmq

from cache_indexer.schemas import block_hash
from cache_indexer.schemas.block_hash import BlockHasher
from tests.conftest import needs_native

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def accelerated():
    needs_native(block_hash._blockhash is not None, "the block hasher's C accelerator")


@pytest.fixture
def bulk_receive():
    from cache_indexer.bridge import zmq_drain
    needs_native(zmq_drain.drainer(zmq.Context.instance().socket(zmq.PAIR)) is not None,
                 "the bridge's bulk ZMQ receive")


def child(code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("how", ["index", "digest"])
def test_a_token_list_resized_while_python_runs_is_no_use_after_free(how, accelerated):
    done = child(f"""
        import hashlib
        from schemas import _blockhash
        tokens = list(range(4096))

        junk = []

        def shrink():  # the item array freed, and its memory handed out again, filled with zeros
            tokens.clear()
            junk.extend(bytes(32760) for _ in range(64))

        class Shrinks:
            def __index__(self):
                shrink()
                return 7

        def digest(data):
            shrink()
            return hashlib.sha256(data).digest()

        if "{how}" == "index":
            tokens[3] = Shrinks()
            args = (b"p" * 32, tokens, 16, 0, 256, True, hashlib.sha256, True)
        else:
            args = (b"p" * 32, tokens, 16, 0, 256, True, digest, False)
        try:
            out = _blockhash.chain(*args)
            print("ok", len(out))
        except TypeError as exc:  # left to the Python path
            print("refused", exc)
    """)
    assert done.returncode == 0, f"the child died ({done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith(("ok 256", "refused")), done.stdout


@pytest.mark.parametrize("bs, first, n", [(2**61, 0, 8), (2**62, 2, 2), (2**63 - 1, 1, 1), (16, 2**62, 2**62)])
def test_block_ranges_that_overflow_are_refused_not_looped_over(bs, first, n, accelerated):
    done = child(f"""
        import hashlib
        from array import array
        from schemas import _blockhash
        for tokens in (array("Q", range(64)), list(range(64))):
            try:
                _blockhash.chain(b"p" * 32, tokens, {bs}, {first}, {n}, True, hashlib.sha256, True)
                print("accepted")
            except (ValueError, OverflowError) as exc:
                print("refused", type(exc).__name__)
    """, timeout=20)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["refused", "ValueError"] * 2, done.stdout


@pytest.mark.parametrize("algo", ["sha256_cbor", "sha256", "xxhash_cbor", "xxhash"])
def test_booleans_hash_as_the_reference_encodes_them(algo):
    tokens = [True, False, 1, 0, 5, True, 7, 8]
    fast, reference = BlockHasher(algo, "0"), BlockHasher(algo, "0", accelerate=False)
    assert fast.block_hashes(tokens, 4) == reference.block_hashes(tokens, 4)
    assert fast.block_hashes(tokens, 4) != fast.block_hashes([1, 0, 1, 0, 5, 1, 7, 8], 4), "booleans are not ints"


def test_the_bulk_receive_binds_pyzmqs_libzmq_even_beside_another(tmp_path, bulk_receive):
    """Another copy of libzmq mapped into the process (a library that brings its own): the bulk receive
    still binds the one pyzmq's backend uses (before: two mapped, it fell back to pyzmq; one foreign one
    alone would have been bound, and pyzmq's sockets handed to it)."""
    libs = [line.rsplit(" ", 1)[-1].strip() for line in Path("/proc/self/maps").read_text().splitlines()
            if "/libzmq" in line]
    assert libs, "pyzmq's libzmq is mapped"
    foreign = tmp_path / "libzmq-foreign.so.5"
    shutil.copy(libs[0], foreign)
    done = child(f"""
        import ctypes, zmq
        ctypes.CDLL({str(foreign)!r}, mode=ctypes.RTLD_LOCAL)  # mapped, not pyzmq's
        from bridge import zmq_drain, _zmq_drain
        ctx = zmq.Context()
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.bind("inproc://x"); b.connect("inproc://x")
        drain = zmq_drain.drainer(b)
        assert drain is not None, "not bound"
        a.send_multipart([b"t", b"s", b"p"])
        while not b.poll(1000): pass
        print(_zmq_drain.bound_library()); print(drain(4))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    bound, received = done.stdout.splitlines()
    assert Path(bound).resolve() == Path(libs[0]).resolve() and "foreign" not in bound
    assert received == "([[b't', b's', b'p']], None)"


def test_a_receive_that_fails_mid_burst_keeps_what_came_and_the_message_boundaries(bulk_receive):
    from cache_indexer.bridge import _zmq_drain
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://mid-burst")
    b.connect("inproc://mid-burst")
    try:
        sent = [[b"topic", i.to_bytes(8, "big"), b"payload %d" % i] for i in range(5)]
        for m in sent:
            a.send_multipart(m)
        assert b.poll(5000)
        # frame 4 of the call (the second frame of message 1) fails as an allocation would
        got, error = _zmq_drain.drain(b.underlying, 10, 4)
        assert got == sent[:1] and isinstance(error, MemoryError), (got, error)
        got, error = _zmq_drain.drain(b.underlying, 10)
        assert got == sent[2:] and error is None, "message 1 lost whole; 2.. whole, none cut in half"
    finally:
        a.close(0)
        b.close(0)
        ctx.term()

