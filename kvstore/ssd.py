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
import time
from typing import Sequence

import lmdb
import numpy as np
import xxhash

from .errors import InvalidArgument, StorageError
from .payload import ByteView, copy_bytes
from .pools import PagePool
from .tiers import Tier

log = logging.getLogger(__name__)
_PAGE_OVERHEAD = 2 * 4096  # lmdb overflow-page rounding and the checksum record
DAMAGE_ACTIONS = ("refuse", "move-aside")  # what to do with a damaged data file at start
# lmdb's verdicts on a data file that is not a sound environment (not access or space problems)
_DAMAGE = (
    lmdb.InvalidError,
    lmdb.CorruptedError,
    lmdb.PageNotFoundError,
    lmdb.VersionMismatchError,
    lmdb.PanicError,
)


class SsdPool(PagePool):
    tier = Tier.SSD

    def __init__(
        self, path: str, num_pages: int, page_bytes: int, on_damage: str = "refuse"
    ) -> None:
        if on_damage not in DAMAGE_ACTIONS:
            raise InvalidArgument(
                f"--ssd-damaged (ssd_damaged) must be one of {DAMAGE_ACTIONS}, got {on_damage!r}"
            )
        self.path, self.num_pages, self.page_bytes = path, num_pages, page_bytes
        self.corrupt_pages = 0
        self.moved_aside: str | None = None  # where a damaged data file went (move-aside)
        self._stale: set[bytes] = set()  # keys whose delete failed: retried with the next write
        self._map_size = num_pages * (page_bytes + _PAGE_OVERHEAD) + (64 << 20)
        data = os.path.join(path, "data.mdb")
        damage = self._open()
        if damage is None:
            return
        if on_damage == "refuse":
            raise StorageError(
                f"the SSD tier's lmdb file {data} is damaged ({damage}); start with "
                "--ssd-damaged=move-aside to keep it renamed next to it and start with an empty "
                "SSD tier, or restore the file"
            )
        self.moved_aside = f"{data}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        try:
            os.replace(data, self.moved_aside)
        except OSError as e:
            raise StorageError(f"cannot move the damaged {data} aside: {e}") from None
        log.warning(
            "the SSD tier's lmdb file %s is damaged (%s): moved it to %s, starting empty",
            data,
            damage,
            self.moved_aside,
        )
        damage = self._open()
        if damage is not None:  # a fresh file cannot be damaged: something else is wrong
            raise StorageError(f"the new SSD tier file {data} is unusable: {damage}")

    def _open(self) -> str | None:
        """Open (or create) the environment; what is wrong with its data file, else None.

        NOTE: lmdb maps the file and trusts it: a file cut short makes the first read past its
        end a SIGBUS, and an empty one silently opens as a new, empty store. So the file is
        checked before (an empty file) and after opening (shorter than its last page; a tree
        that does not walk), before any read of a page.
        """
        path, data = self.path, os.path.join(self.path, "data.mdb")
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            if os.path.exists(data) and os.path.getsize(data) == 0:
                return "it is empty: truncated"
            # mode: data.mdb and lock.mdb are created 0600 (pages are tenants' KV cache)
            env = lmdb.open(
                path,
                map_size=self._map_size,
                max_dbs=2,
                subdir=True,
                readahead=False,
                metasync=False,
                sync=False,
                lock=True,
                mode=0o600,
            )
        except _DAMAGE as e:
            return str(e)
        except (OSError, lmdb.Error) as e:
            raise StorageError(
                f"cannot open the SSD tier at {path!r}: {e}; give --ssd-dir a writable directory"
            ) from None
        try:
            psize, last = env.stat()["psize"], env.info()["last_pgno"]
            size = os.path.getsize(data)
            if size < (last + 1) * psize:
                env.close()
                return f"{size} bytes, but its pages run to byte {(last + 1) * psize}: truncated"
            self._pages = env.open_db(b"pages")
            self._sums = env.open_db(b"sums")
            with env.begin() as txn:
                for db in (self._pages, self._sums):
                    for _ in txn.cursor(db=db).iternext(keys=True, values=False):
                        pass
        except _DAMAGE as e:
            env.close()
            return str(e)
        except (OSError, lmdb.Error) as e:
            env.close()
            raise StorageError(f"cannot read the SSD tier at {path!r}: {e}") from None
        for name in ("data.mdb", "lock.mdb"):  # files an older version created 0644
            try:
                os.chmod(os.path.join(path, name), 0o600)
            except OSError:
                pass
        self.env = env
        return None

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
            full = "its lmdb map is full" if isinstance(e, lmdb.MapFullError) else "disk full?"
            raise StorageError(
                f"cannot write {len(keys)} pages to the SSD tier at {self.path!r} ({full}): {e}"
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
            if not self._stale:  # once per episode, not per eviction
                log.warning("cannot delete SSD pages yet (%s); retrying with the next write", e)
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
