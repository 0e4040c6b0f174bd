"""Shared memory: named POSIX slabs that several processes map by name, and anonymous memfd
segments that are handed to chosen processes as file descriptors (no name anyone could open).

We use ``_posixshmem`` + ``mmap`` directly instead of ``multiprocessing.shared_memory`` because the
latter registers attached segments with the resource tracker, which unlinks them when *any*
attaching process exits (fixed only in Python 3.13 with ``track=False``).
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's shm_open, no stubs
import ctypes
import fcntl
import mmap
import os
import re
import secrets
import socket
import time
import weakref

import numpy as np
import xxhash

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
    space up front turns that into a clear error at start; ``reserve`` (the store's default)
    closes the remaining race with other users of /dev/shm by allocating every page now.
    """
    free = shm_free_bytes(directory)
    if free is not None and size > free:
        raise StorageError(
            f"{what} needs {size} bytes ({size / 2**20:.1f} MiB) of shared memory, but "
            f"{directory} has only {free} bytes ({free / 2**20:.1f} MiB) free; lower --dram, or "
            f"enlarge {directory} (e.g. mount -o remount,size=8G {directory}; docker run "
            "--shm-size=8g) or free space there"
        )


def shm_identity() -> str | None:
    """8 hex digits naming this boot of this host and this process's PID namespace: the scope in
    which a pid names one process. None when either cannot be read.

    NOTE: /dev/shm can be shared across PID namespaces (containers with the host's IPC, or with
    each other's): pid 1234 there is another process than pid 1234 here, so a segment's pid says
    whether its creator lives only for segments made under the same identity.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    return xxhash.xxh32_hexdigest(f"{boot}|{pidns}".encode())


def unique_shm_name(prefix: str = "kvcache") -> str:
    """``PREFIX-IDENTITY-PID-RANDOM``: the identity and pid let ``sweep_orphans`` tell whether
    the creator still runs. Without an identity the name has none, and is never swept."""
    ident = shm_identity()
    scope = f"{ident}-" if ident else ""
    return f"{prefix}-{scope}{os.getpid()}-{secrets.token_hex(4)}"


_MADV_POPULATE_WRITE = 23  # Linux 5.14; Python's mmap module names it from 3.13 on
_PREFAULT_CHUNK = 32 << 20


def prefault(array: np.ndarray) -> bool:
    """Map every page of ``array`` (a shared mapping, page-aligned) into this process now,
    writable: later copies into and out of it take no page faults. A fault per 4 KiB page costs
    microseconds (on a VM, a copy into a fresh mapping ran at a fifth of memcpy's speed), and
    every process pays them for its own mapping, even for pages others touched. Pages the
    segment does not back yet are allocated (as a write would). In chunks, without the GIL
    (ctypes releases it). False when the kernel lacks MADV_POPULATE_WRITE or a chunk fails
    (e.g. the memory is gone)."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    base, size = array.ctypes.data, array.nbytes
    for off in range(0, size, _PREFAULT_CHUNK):
        if madvise(base + off, min(_PREFAULT_CHUNK, size - off), _MADV_POPULATE_WRITE) != 0:
            return False
    return True


def _unlink(name: str) -> None:
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass


class SharedSlab:
    """A read-write mapping of ``/dev/shm/<name>``. The creator owns it and unlinks it."""

    def __init__(
        self,
        name: str,
        size: int | None = None,
        create: bool = False,
        reserve: bool = False,
        check_room: bool = True,
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
                if check_room:  # NOTE: not for a budget's sparse slab: its room is held
                    check_shm_room(size, f"shared memory slab {name!r}")
                os.ftruncate(fd, size)
                if reserve:
                    # NOTE: reserve tmpfs pages now so that a full /dev/shm fails here with a clear
                    # error instead of a SIGBUS on some later page write, in whichever process
                    # (node or same-host client) writes that page first.
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        raise StorageError(
                            f"cannot reserve {size} bytes ({size / 2**20:.1f} MiB) of shared "
                            f"memory for {name!r}: {e.strerror}; lower --dram, or enlarge "
                            f"{SHM_DIR} (docker run --shm-size=...) or free space there; "
                            "(--no-reserve-shm starts anyway, and a write that finds /dev/shm "
                            "full later dies of SIGBUS)"
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

    def punch(self, offset: int, length: int) -> None:
        """Give the pages of ``[offset, offset + length)`` back (they read as zeros after)."""
        punch(self._mmap, self.array, offset, length)

    @classmethod
    def create(
        cls, name: str, size: int, reserve: bool = False, check_room: bool = True
    ) -> "SharedSlab":
        return cls(name, size, create=True, reserve=reserve, check_room=check_room)

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


class ShmBallast:
    """Room in /dev/shm held for sparse slabs that share a budget (``budget.SharedBudget``):
    a /dev/shm file of the budget's size, reserved at start (``posix_fallocate``), that gives
    back what a store is granted (a hole punched) and takes back what a store gives up. So the
    slabs' pages, written long after start, find the room a full /dev/shm would otherwise have
    taken (a SIGBUS in whichever process writes first), as a reserved slab's do."""

    def __init__(self, size: int) -> None:
        self.slab = SharedSlab.create(unique_shm_name(), size, reserve=True)
        self.reserved = size  # bytes [0, reserved) are backed
        self.failed = False  # taking room back failed once (logged by the caller)

    def take(self, nbytes: int) -> None:
        """``nbytes`` of the room go to a store's slab."""
        new = max(0, self.reserved - nbytes)
        start, end = page_up(new), page_up(self.reserved)
        if end > start:
            self.slab.punch(start, end - start)
        self.reserved = new

    def give(self, nbytes: int) -> None:
        """A store gave ``nbytes`` back (punched out of its slab): hold that room again."""
        new = min(self.slab.size, self.reserved + nbytes)
        try:
            fd = _posixshmem.shm_open("/" + self.slab.name, os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(fd, self.reserved, new - self.reserved)
            finally:
                os.close(fd)
        except OSError:
            self.failed = True  # another process took the room meanwhile: not held any more
            return
        self.reserved = new

    def close(self) -> None:
        self.slab.close()
        self.slab.unlink()


def page_up(n: int) -> int:
    """``n`` rounded up to a whole number of system pages."""
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


def punch(mapping: mmap.mmap, array: np.ndarray, offset: int, length: int) -> None:
    """Give the system pages of ``[offset, offset + length)`` of a shared mapping back to the
    system (``MADV_REMOVE``: a hole in its file); they read as zeros after."""
    try:
        mapping.madvise(mmap.MADV_REMOVE, offset, length)
    except (OSError, ValueError):
        array[offset : offset + length] = 0  # still wipe what the range held


_ORPHAN = re.compile(r"^kvcache-([0-9a-f]{8})-(\d+)-[0-9a-f]{8}$")


def sweep_orphans(directory: str = SHM_DIR) -> list[str]:
    """Unlink slabs whose creating process is gone (a node that was SIGKILLed cannot clean up).

    Only slabs that are provably orphans go: named by ``unique_shm_name`` under this process's
    identity (same boot, same PID namespace: their pid means here what it meant to the creator),
    owned by this user, and with no process of that pid. Slabs of other PID namespaces, of other
    users, or with names of an older format are left alone. Returns the names removed.
    """
    removed: list[str] = []
    ident = shm_identity()
    if ident is None:
        return removed  # cannot tell whose pids the names carry
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = _ORPHAN.match(name)
        if m is None or m.group(1) != ident:
            continue
        if pid_alive(int(m.group(2))):
            continue  # the creator still runs
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue  # another user's: not ours to judge (nor, in sticky /dev/shm, to unlink)
            os.unlink(path)
        except OSError:
            continue  # gone meanwhile, or not ours to remove: never a reason to fail a start
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


class MemfdSegment:
    """An anonymous shared-memory segment (``memfd_create``): it has no name in /dev/shm, so the
    only way into it is its file descriptor, which its creator hands to chosen processes over a
    Unix-domain socket (``send_segment`` / ``recv_segment``).

    A created segment is sealed against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW |
    F_SEAL_SEAL``): a process it was handed to cannot ``ftruncate`` it and so cannot make the
    creator's next access of a page a SIGBUS. Pages are backed on first write (like a tmpfs file),
    or at once with ``reserve``; ``punch`` gives pages back to the system. A memfd lives on the
    kernel's internal tmpfs, not in /dev/shm: a full /dev/shm does not touch it (memory and its
    cgroup limit it, as any allocation).
    """

    name = ""  # no name: never in /dev/shm

    def __init__(
        self,
        size: int | None = None,
        label: str = "kvcache",
        reserve: bool = False,
        fd: int | None = None,
    ) -> None:
        self.owner = fd is None
        if fd is None:
            if not size or size <= 0:
                raise StorageError("a new memfd segment needs a positive size")
            fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                os.ftruncate(fd, size)
                if reserve:
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        raise StorageError(
                            f"cannot reserve {size} bytes ({size / 2**20:.1f} MiB) of memory "
                            f"for {label!r}: {e.strerror}; lower --dram or give the node more "
                            "memory"
                        ) from None
                seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            except BaseException:
                os.close(fd)
                raise
        else:
            size = os.fstat(fd).st_size
            if size <= 0:
                os.close(fd)
                raise StorageError("the shared memory segment handed over is empty")
        self.fd, self.size = fd, size
        try:
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def punch(self, offset: int, length: int) -> None:
        """Give the pages of ``[offset, offset + length)`` back (they read as zeros after)."""
        punch(self._mmap, self.array, offset, length)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass  # views are still alive elsewhere; the mapping goes when they do
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unlink(self) -> None:
        """Nothing to unlink: the segment goes with its last descriptor and mapping."""


# The fd-passing exchange on a node's segment socket: the client sends one line
# ``SHM_HELLO <ticket hex>\n``; the node answers ``OK <size>\n`` with the segment's fd attached
# (SCM_RIGHTS), or ``DENIED <reason>\n`` and no fd.
SHM_HELLO = b"KVCACHE-SHM/1"
_MAX_LINE = 256


def socket_address(name: str) -> str | bytes:
    """A socket name as told to clients -> what ``connect``/``bind`` take: ``@name`` is Linux's
    abstract namespace (no file, gone with the socket), anything else a filesystem path."""
    return b"\0" + name[1:].encode() if name.startswith("@") else name


def _read_line(sock: socket.socket, deadline: float | None = None) -> bytes:
    """One line (at most ``_MAX_LINE`` bytes). ``deadline`` (monotonic): the whole line must
    arrive by then (``TimeoutError``), not each read within the socket's timeout: a peer that
    trickles a byte at a time would hold the reader for as long as it likes."""
    buf = b""
    while not buf.endswith(b"\n"):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the line did not arrive in time")
            sock.settimeout(left)
        part = sock.recv(_MAX_LINE - len(buf))
        if not part:
            break
        buf += part
        if len(buf) >= _MAX_LINE:
            break
    return buf


def read_hello(sock: socket.socket, timeout_s: float | None = None) -> bytes | None:
    """The ticket a client's hello line carries, or None for anything else. ``timeout_s``: for
    the whole line (``TimeoutError`` past it)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    words = _read_line(sock, deadline).split()
    if len(words) != 2 or words[0] != SHM_HELLO:
        return None
    try:
        return bytes.fromhex(words[1].decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return None


def send_segment(sock: socket.socket, segment: MemfdSegment) -> None:
    socket.send_fds(sock, [b"OK %d\n" % segment.size], [segment.fd])


def deny(sock: socket.socket, reason: str) -> None:
    try:
        sock.sendall(b"DENIED " + reason.encode("ascii", "replace") + b"\n")
    except OSError:
        pass


# A node's session socket (node/sessions.py): the client connects and keeps the connection for
# its life; the node answers one line ``SESSION_HELLO <id hex>\n`` and then only watches it close.
SESSION_HELLO = b"KVCACHE-SESSION/1"


def open_session(address: str, timeout_s: float = 5.0) -> tuple[socket.socket, bytes]:
    """Connect to a node's session socket: the connection to hold, and the session id. Raises
    ``StorageError`` when refused or unreachable."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(socket_address(address))
        words = _read_line(sock).split()
        if len(words) != 2 or words[0] != SESSION_HELLO:
            raise OSError("refused (too many sessions?)")
        sid = bytes.fromhex(words[1].decode("ascii"))
    except (OSError, ValueError) as e:
        sock.close()
        raise StorageError(f"no session with the node at {address}: {e}") from None
    return sock, sid


def recv_segment(address: str, ticket: bytes, timeout_s: float = 5.0) -> MemfdSegment:
    """Present ``ticket`` on the node's segment socket and map the segment it hands back.
    Raises ``StorageError`` when refused or unreachable."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(socket_address(address))
            sock.sendall(SHM_HELLO + b" " + ticket.hex().encode() + b"\n")
            msg, fds, _, _ = socket.recv_fds(sock, _MAX_LINE, 1)
        except OSError as e:
            raise StorageError(f"cannot reach the node's segment socket {address}: {e}") from None
    if not msg.startswith(b"OK ") or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        reason = msg.decode("ascii", "replace").strip() or "connection closed"
        raise StorageError(f"the node refused its shared memory: {reason}")
    return MemfdSegment(fd=fds[0])
