"""Named POSIX shared memory slabs that several processes map by name.

We use ``_posixshmem`` + ``mmap`` directly instead of ``multiprocessing.shared_memory`` because the
latter registers attached segments with the resource tracker, which unlinks them when *any*
attaching process exits (fixed only in Python 3.13 with ``track=False``).
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's shm_open, no stubs
import mmap
import os
import re
import secrets
import weakref

import numpy as np

from .errors import StorageError

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (shm_open names)


def shm_free_bytes(directory: str = SHM_DIR) -> int | None:
    """Bytes free for new shared memory, or None when unknown (no such filesystem, or a tmpfs
    without a size limit)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    if st.f_blocks == 0:  # tmpfs mounted with size=0: no limit
        return None
    return st.f_bavail * st.f_frsize


def check_shm_room(size: int, what: str, directory: str = SHM_DIR) -> None:
    """Refuse ``size`` bytes of shared memory that ``directory`` has no room for.

    NOTE: a slab is a sparse tmpfs file: creating it always works, and the process that first
    writes a page the filesystem cannot back dies of SIGBUS, long after start. Checking the free
    space up front turns that into a clear error at start (``reserve`` closes the remaining race
    with other users of /dev/shm by allocating every page now).
    """
    free = shm_free_bytes(directory)
    if free is not None and size > free:
        raise StorageError(
            f"{what} needs {size} bytes ({size / 2**20:.1f} MiB) of shared memory, but "
            f"{directory} has only {free} bytes ({free / 2**20:.1f} MiB) free; lower --dram, or "
            f"enlarge {directory} (e.g. mount -o remount,size=8G {directory}; docker run "
            "--shm-size=8g) or free space there"
        )


def unique_shm_name(prefix: str = "kvcache") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


class SharedSlab:
    """A read-write mapping of ``/dev/shm/<name>``. The creator owns it and unlinks it."""

    def __init__(
        self, name: str, size: int | None = None, create: bool = False, reserve: bool = False
    ) -> None:
        if not name or "/" in name:
            raise StorageError(f"invalid shared memory name {name!r}: use letters, digits, '-'")
        self.name = name
        self.owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = _posixshmem.shm_open("/" + name, flags, 0o600)
        except FileExistsError:
            raise StorageError(f"shared memory segment {name!r} already exists") from None
        except FileNotFoundError:
            raise StorageError(f"shared memory segment {name!r} does not exist") from None
        try:
            if create:
                if not size or size <= 0:
                    raise StorageError("a new shared memory slab needs a positive size")
                check_shm_room(size, f"shared memory slab {name!r}")
                os.ftruncate(fd, size)
                if reserve:
                    # NOTE: reserve tmpfs pages now so that a full /dev/shm fails here with a clear
                    # error instead of a SIGBUS on some later page write.
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        raise StorageError(
                            f"cannot reserve {size} bytes of shared memory for {name!r}: {e}; "
                            "lower --dram or enlarge /dev/shm"
                        ) from None
            else:
                size = os.fstat(fd).st_size
            self.size = size
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            if create:
                _posixshmem.shm_unlink("/" + name)
            raise
        os.close(fd)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        # NOTE: an owner that is never closed (an exception before close, a forgotten close)
        # still removes /dev/shm/<name> when collected or at interpreter exit, instead of
        # leaking tmpfs memory until reboot. Only a killed process leaves its segment behind.
        self._unlinker = weakref.finalize(self, _unlink, name) if create else None

    @classmethod
    def create(cls, name: str, size: int, reserve: bool = False) -> "SharedSlab":
        return cls(name, size, create=True, reserve=reserve)

    @staticmethod
    def remove(name: str) -> None:
        """Unlink a segment by name (no error if it is gone)."""
        _unlink(name)

    @classmethod
    def attach(cls, name: str) -> "SharedSlab":
        return cls(name)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # views are still alive elsewhere; the mapping goes when they do

    def unlink(self) -> None:
        if self._unlinker is not None:
            self._unlinker()  # runs once; also cancels the at-exit unlink
        else:
            _unlink(self.name)

    def __enter__(self) -> "SharedSlab":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()


_ORPHAN = re.compile(r"^kvcache-(\d+)-[0-9a-f]{8}$")


def sweep_orphans(directory: str = "/dev/shm") -> list[str]:
    """Unlink slabs whose creating process is gone (a node that was SIGKILLed cannot clean up).

    Names carry the creator's pid (``unique_shm_name``); a slab is an orphan when no process with
    that pid exists. Returns the names removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _ORPHAN.match(name)
        if m is None:
            continue
        if pid_alive(int(m.group(1))):
            continue  # the creator still runs
        _unlink(name)
        removed.append(name)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (another user's counts; a zombie child of ours is
    reaped and does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:  # not our child: it exists
        return True
