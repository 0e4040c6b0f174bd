"""Pages copied and checksummed in one pass (kvstore/_copy_hash.h): each instruction set's loop
gives python-xxhash's xxh3-64 of the bytes and copies them exactly, at every length around its
chunk size; a page hashed a layer at a time (PageHasher) gets the same checksum; the store's puts
and reads keep the checksums readers check against."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import payload
from kvstore.errors import InvalidArgument
from kvstore.payload import LayerChecksums, PageHasher, copy_checksum
from kvstore.shm import SharedSlab

from kvstore_helpers import LAYOUT, key, make_store, page

CHUNK = 16 * 1024
needs_c = pytest.mark.skipif(
    payload._copy_hash_c is None,
    reason="kvstore._native is not built (pip install -e . builds it where xxhash.h is installed)",
)
LENGTHS = [0, 1, 63, 64, 255, 256, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7, 1 << 20]


@given(data=st.binary(max_size=3 * CHUNK + 300))
@settings(max_examples=60, deadline=None)
def test_copy_checksum_copies_and_gives_the_xxh3_of_the_bytes(data):
    src = np.frombuffer(data, dtype=np.uint8)
    dst = np.full(len(data), 0xA5, dtype=np.uint8)
    assert copy_checksum(dst, src) == xxhash.xxh3_64_intdigest(data)
    assert dst.tobytes() == data


@needs_c
@pytest.mark.parametrize("isa", ["sse2", "avx2", "avx512"])
def test_each_instruction_sets_loop_gives_the_python_twins_checksum(isa):
    """In a process whose loop is capped at ``isa`` (KVSTORE_COPY_HASH_ISA): every length around
    the chunk size, copied exactly, the checksum python-xxhash gives; and the Python twin agrees."""
    script = f"""
import numpy as np, xxhash
from kvstore import _native, payload
rng = np.random.default_rng(5)
for n in {LENGTHS}:
    src = rng.integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    h = _native.copy_hash(dst, src)
    assert h == xxhash.xxh3_64_intdigest(src), n
    assert np.array_equal(dst, src), n
    payload._copy_hash_c = None  # the Python twin, on the same bytes
    assert payload.copy_checksum(np.zeros(n, np.uint8), src) == h, n
    payload._copy_hash_c = _native.copy_hash
pages = [rng.integers(0, 256, 32 * 1024, dtype=np.uint8) for _ in range(3)]
hasher = _native.PageHasher(3)
for layer in range(8):  # a layer-wise write's slices, in page order
    hasher.update(pages, layer * 4096, 4096)
assert hasher.digests() == [xxhash.xxh3_64_intdigest(p) for p in pages]
# The same slices copied and hashed in one pass, from strided rows (pages a stride apart in
# one buffer, walked backwards; sources rows of a tensor): same bytes, same digests.
slab = np.zeros((3, 40 * 1024), np.uint8)
dst = slab[::-1, : 32 * 1024]
src = np.stack(pages)[::-1]
fused = _native.PageHasher(3)
for layer in range(8):
    for half in range(2):
        a = layer * 4096 + half * 2048
        fused.copy_update(0, dst[:, a : a + 2048], src[:, a : a + 2048])
assert np.array_equal(dst, src)
assert fused.digests() == [xxhash.xxh3_64_intdigest(p) for p in pages[::-1]]
print(_native.COPY_HASH_ISA)
"""
    env = {**os.environ, "KVSTORE_COPY_HASH_ISA": isa}
    r = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    # The loop that ran: the one asked for, or a narrower one where this CPU lacks it.
    widths = ["baseline", "sse2", "avx2", "avx512"]
    assert widths.index(r.stdout.strip()) <= widths.index(isa)


@needs_c
def test_bad_buffers_get_a_clear_error():
    with pytest.raises(InvalidArgument, match="copy of"):
        copy_checksum(np.zeros(8, np.uint8), np.zeros(9, np.uint8))
    with pytest.raises(ValueError, match="9 bytes into a buffer of 8"):
        payload._copy_hash_c(np.zeros(8, np.uint8), np.zeros(9, np.uint8))
    with pytest.raises(TypeError):  # read-only destination
        payload._copy_hash_c(b"12345678", np.zeros(8, np.uint8))
    both = np.zeros(16, np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        payload._copy_hash_c(both[:8], both[4:12])
    hasher = PageHasher(2)
    with pytest.raises(ValueError, match="1 pages for 2 states"):
        hasher.update([b"ab"], 0, 1)
    with pytest.raises(ValueError, match="page #1 has 1 bytes"):
        hasher.update([b"ab", b"c"], 1, 1)
    with pytest.raises(ValueError, match="n must be"):
        PageHasher(-1)
    rows = np.zeros((2, 8), np.uint8)
    with pytest.raises(ValueError, match="of one byte size"):
        hasher.copy_update(0, rows, np.zeros((2, 9), np.uint8))
    with pytest.raises(ValueError, match="each contiguous"):  # rows not contiguous
        hasher.copy_update(0, rows, np.zeros((2, 16), np.uint8)[:, ::2])
    with pytest.raises(ValueError, match=r"rows \[1, 1 \+ 2\) of 2 states"):
        hasher.copy_update(1, rows, np.zeros((2, 8), np.uint8))
    with pytest.raises(ValueError, match="overlap"):
        hasher.copy_update(0, rows, rows)
    with pytest.raises((TypeError, BufferError, ValueError)):  # a read-only destination
        hasher.copy_update(0, np.frombuffer(bytes(16), np.uint8).reshape(2, 8), rows)
    # Strided views take the copy-then-hash path, with the same result.
    src = np.arange(64, dtype=np.uint8)[::2]
    assert copy_checksum(np.zeros(32, np.uint8), src) == xxhash.xxh3_64_intdigest(src.tobytes())


def test_puts_and_reads_keep_the_checksums_readers_check():
    """A page put through the store carries the xxh3 of its bytes; a read copies it out whole;
    a page scribbled on after its commit fails its read (and is dropped), whichever path ran."""
    with make_store(dram_pages=4) as store:
        pages = [page(i) for i in range(3)]
        store.put([key(i) for i in range(3)], pages)
        lease = store.acquire([key(i) for i in range(3)])
        try:
            assert store.checksums(lease) == [xxhash.xxh3_64_intdigest(p) for p in pages]
            out = np.zeros(LAYOUT.page_bytes, np.uint8)
            assert store.copy_out(lease, 1, out) and out.tobytes() == pages[1].tobytes()
            slab = SharedSlab.attach(store.shm_name)  # a writer that kept its view scribbles
            slab.array[lease.slots[2] * LAYOUT.page_bytes + 100] ^= 0xFF
            slab.close()
            assert not store.copy_out(lease, 2, out)
        finally:
            store.release(lease.lease_id)
        assert store.contains([key(0), key(1), key(2)]) == [True, True, False]


@needs_c
def test_layer_checksums_are_the_pages_own_in_order_and_none_out_of_order():
    rng = np.random.default_rng(3)
    pages = [rng.integers(0, 256, 4 * 1024, dtype=np.uint8) for _ in range(2)]
    sums = LayerChecksums.make(pages, 1024)
    for layer in range(4):
        sums.layer(layer)
    want = [0, xxhash.xxh3_64_intdigest(pages[0]), 0, xxhash.xxh3_64_intdigest(pages[1])]
    assert list(sums.sums(4, [1, 3], 4)) == want
    assert sums.sums(4, [1, 3], 5) is None  # a layer never hashed
    skipped = LayerChecksums.make(pages, 1024)
    for layer in (0, 2, 1, 3):
        skipped.layer(layer)
    assert skipped.sums(4, [1, 3], 4) is None


@needs_c
def test_layer_copies_hash_as_they_copy_and_step_aside_when_they_cannot():
    """``LayerChecksums.copies``: runs of pages filled a layer at a time, K then V, give the
    pages' own checksums; a layer out of order, rows that are not contiguous, or runs that do
    not cover every page copy nothing and leave it to ``layer``."""
    rng = np.random.default_rng(4)
    n, layers, half = 4, 3, 512
    slab = np.zeros((n, layers, 2, half), np.uint8)
    pages = [slab[i].reshape(-1) for i in range(n)]
    k = rng.integers(0, 256, (layers, n, half), dtype=np.uint8)
    v = rng.integers(0, 256, (layers, n, half), dtype=np.uint8)
    sums = LayerChecksums.make(pages, 2 * half)
    for layer in range(layers):
        runs = [  # two runs: pages 0-1, then 2-3
            [(slab[a:b, layer, 0], k[layer, a:b]), (slab[a:b, layer, 1], v[layer, a:b])]
            for a, b in ((0, 2), (2, 4))
        ]
        assert not sums.copies(layer + 1, runs)  # out of order: nothing copied
        assert not slab[:, layer].any()
        assert not sums.copies(layer, runs[:1])  # page 2 and 3 not covered
        assert not sums.copies(layer, [[(d, s[:, ::-1]) for d, s in r] for r in runs])
        assert not slab[:, layer].any()
        assert sums.copies(layer, runs)
        assert np.array_equal(slab[:, layer, 0], k[layer])
        assert np.array_equal(slab[:, layer, 1], v[layer])
    want = [xxhash.xxh3_64_intdigest(p) for p in pages]
    assert list(sums.sums(n, range(n), layers)) == want
