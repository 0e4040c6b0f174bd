"""The SSD tier: pages as lmdb values keyed by block key, each with an xxh3-64 checksum.

Checksums live in a second database of the same environment so that a page is written straight
from its source view (no concatenation copy) and both are committed in one transaction. Reads use
``buffers=True`` (a view into lmdb's map, no copy) and verify the checksum before copying out; a
corrupt page is deleted and reported as a miss, never returned.

A write that lmdb refuses (a full filesystem, a full map) raises ``StorageError`` and leaves the
environment usable: lmdb aborts the transaction, and the next one succeeds once space returns.
A delete that fails is remembered and retried with the next write, so a full disk never leaves a
record that the index no longer owns.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import lmdb
import numpy as np
import xxhash

from .errors import StorageError
from .payload import ByteView, copy_bytes
from .pools import PagePool
from .tiers import Tier

log = logging.getLogger(__name__)
_PAGE_OVERHEAD = 2 * 4096  # lmdb overflow-page rounding and the checksum record


class SsdPool(PagePool):
    tier = Tier.SSD

    def __init__(self, path: str, num_pages: int, page_bytes: int) -> None:
        self.path, self.num_pages, self.page_bytes = path, num_pages, page_bytes
        self.corrupt_pages = 0
        self._stale: set[bytes] = set()  # keys whose delete failed: retried with the next write
        map_size = num_pages * (page_bytes + _PAGE_OVERHEAD) + (64 << 20)
        try:
            os.makedirs(path, exist_ok=True)
            self.env = lmdb.open(
                path,
                map_size=map_size,
                max_dbs=2,
                subdir=True,
                readahead=False,
                metasync=False,
                sync=False,
                lock=True,
            )
            self._pages = self.env.open_db(b"pages")
            self._sums = self.env.open_db(b"sums")
        except (OSError, lmdb.Error) as e:
            raise StorageError(
                f"cannot open the SSD tier at {path!r}: {e}; give --ssd-dir a writable directory"
            ) from None

    def page_view(self, slot: int) -> None:
        return None

    def write_pages(
        self, slots: Sequence[int], keys: Sequence[bytes], datas: Sequence[ByteView]
    ) -> None:
        stale = self._stale - set(keys)
        try:
            with self.env.begin(write=True) as txn:
                for key in stale:
                    txn.delete(key, db=self._pages)
                    txn.delete(key, db=self._sums)
                for key, data in zip(keys, datas):
                    if not isinstance(data, np.ndarray):  # a torch tensor (GPU demotes via host)
                        data = data.cpu().numpy()
                    view = data.data  # the array's buffer: lmdb and xxhash read it, no copy
                    txn.put(key, view, db=self._pages)
                    txn.put(key, xxhash.xxh3_64_digest(view), db=self._sums)
        except lmdb.Error as e:
            raise StorageError(
                f"cannot write {len(keys)} pages to the SSD tier at {self.path!r}: {e} "
                "(is its filesystem full?)"
            ) from None
        self._stale.clear()

    def read_page_into(self, slot: int, key: bytes, out: ByteView) -> bool:
        with self.env.begin(buffers=True) as txn:
            value = txn.get(key, db=self._pages)
            if value is None:
                return False
            checksum = txn.get(key, db=self._sums)
            ok = (
                len(value) == self.page_bytes
                and checksum is not None
                and xxhash.xxh3_64_digest(value) == bytes(checksum)
            )
            if ok:
                copy_bytes(out, np.frombuffer(value, dtype=np.uint8))
        if not ok:
            self.corrupt_pages += 1
            log.warning("dropping corrupt SSD page %s (checksum mismatch)", key.hex())
            self.drop_pages([slot], [key])
        return ok

    def drop_pages(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        try:
            with self.env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(key, db=self._pages)
                    txn.delete(key, db=self._sums)
        except lmdb.Error as e:
            # NOTE: deleting needs free pages too; on a full disk the caller has already let the
            # block go, so forget the records now (stored_keys) and delete them with the next write.
            log.warning("cannot delete %d SSD pages yet (%s); retrying later", len(keys), e)
            self._stale.update(bytes(k) for k in keys)

    def stored_keys(self) -> list[bytes]:
        with self.env.begin() as txn:
            keys = list(txn.cursor(db=self._pages).iternext(keys=True, values=False))
        return [k for k in keys if k not in self._stale] if self._stale else keys

    def close(self) -> None:
        try:
            self.env.sync(True)
        except lmdb.Error as e:  # a full disk must not stop the node from shutting down
            log.warning("cannot sync the SSD tier at %s: %s", self.path, e)
        self.env.close()
