"""Starting kvcache role processes and waiting until they serve.

Every server prints one JSON line ``{"event": "ready", ...}`` on stdout once it listens
(``rpc.server.announce_ready``); ``start_service`` waits for that line with a deadline instead of
sleeping, and reports the process's stderr if it dies first. Used by tests and ``kvcache up``.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rpc.server import TOKEN_ENV

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_PICKS = 12288  # ports below the ephemeral range that free_port picks from


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ephemeral ports (a connection's own port, a listener on port 0)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _pick(host: str) -> socket.socket | None:
    """A socket bound (without SO_REUSEADDR: no other holder of the port) to a random port of
    ``host`` below the ephemeral range; None on a host too crowded there."""
    lo, _ = ephemeral_ports()
    first = max(1024, lo - _PICKS)
    rng = random.SystemRandom()
    for _ in range(64 if lo - first >= 1024 else 0):
        s = socket.socket()
        try:
            s.bind((host, rng.randrange(first, lo)))
        except OSError:
            s.close()
            continue  # taken
        return s
    return None


def free_port(host: str) -> int:
    """A port free on ``host`` now, for a process the caller starts later to listen on.

    Picked at random below the ephemeral range: in it, any outgoing connection or port-0
    listener of the host (another service starting meanwhile) could take the port before the
    process binds it; below it, only another pick like this one can, among thousands."""
    picked = _pick(host)
    if picked is not None:
        with picked:
            return int(picked.getsockname()[1])
    with socket.socket() as s:  # a crowded host: any port free now
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class PortReservation:
    """A port held for a process started later: bound here (not listening) with SO_REUSEADDR
    set after the bind, so that another pick (``free_port``, ``reserve_port``, any bind without
    SO_REUSEADDR, in any process) finds it taken, while the intended server, binding with
    SO_REUSEADDR as vLLM's and gRPC's do, gets it. ``release`` once that server listens."""

    port: int
    sock: socket.socket | None

    def release(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def reserve_port(host: str) -> PortReservation:
    """``free_port``, held until ``release``: for a process that binds long after the pick (a
    vLLM server: a minute or more), during which other picks would find the port free."""
    s = _pick(host)  # exclusive: the bind fails on any holder
    if s is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return PortReservation(int(s.getsockname()[1]), s)
    return PortReservation(free_port(host), None)  # a crowded host: unheld


@dataclass
class ServiceProcess:
    role: str
    proc: subprocess.Popen[str]
    info: dict[str, Any]
    log_path: str
    _drain: threading.Thread | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return str(self.info["address"])

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait for a clean exit, SIGKILL if it does not come. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, like a crash; then remove the shared memory the process could not."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        from kvstore.shm import SharedSlab

        for name in (self.info.get("shm") or {}).values():
            SharedSlab.remove(name)

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""


def process_identity(pid: int) -> dict[str, Any]:
    """What tells process ``pid`` from a later one that reuses its pid: its start time (seconds
    since the epoch) and its command line."""
    import psutil

    p = psutil.Process(pid)
    return {"started": p.create_time(), "cmdline": p.cmdline()}


def still_same_process(pid: int, identity: dict[str, Any]) -> str | None:
    """None when ``pid`` still runs the process ``identity`` (from ``process_identity``)
    describes; otherwise why not ("exited", or what runs under that pid now)."""
    import psutil

    try:
        p = psutil.Process(pid)
        started, cmdline = p.create_time(), p.cmdline()
        if p.status() == psutil.STATUS_ZOMBIE:
            return "exited"
    except psutil.NoSuchProcess:
        return "exited"
    except psutil.AccessDenied:
        return "now another user's process"
    if abs(started - float(identity.get("started", 0.0))) > 0.05 or cmdline != identity.get(
        "cmdline"
    ):
        return f"now another process ({' '.join(cmdline)[:80] or '?'})"
    return None


def child_environ() -> dict[str, str]:
    """This process's environment less the admin token (``$KVCACHE_TOKEN``): a child gets its
    secrets in files, never in an environment every process of its user can read
    (/proc/PID/environ) and that it hands on to its own children."""
    return {k: v for k, v in os.environ.items() if k != TOKEN_ENV}


def start_service(
    args: list[str],
    timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    log_dir: str | None = None,
    new_session: bool = False,
    module: str = "kvcache.cli",
    wrap: list[str] | None = None,
) -> ServiceProcess:
    """Run ``kvcache <args>`` (``python -m module <args>``) in a new process; return once it has
    announced it is ready. ``wrap`` is a command that execs its arguments, e.g. ``ip netns exec
    NS`` (same PID)."""
    fd, log_path = tempfile.mkstemp(prefix=f"kvcache-{args[0]}-", suffix=".log", dir=log_dir)
    log_file = os.fdopen(fd, "w")
    proc = subprocess.Popen(
        [*(wrap or []), sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=log_file,
        text=True,
        bufsize=1,
        env={**child_environ(), **(env or {})},
        start_new_session=new_session,
    )
    log_file.close()
    assert proc.stdout is not None  # stdout=PIPE
    stdout = proc.stdout
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)
    info = None
    try:
        while info is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"kvcache {' '.join(args)} not ready after {timeout_s}s")
            if not sel.select(min(left, 1.0)):
                if proc.poll() is not None:
                    break
                continue
            line = stdout.readline()
            if not line:
                if proc.poll() is None:
                    proc.wait(5)
                break
            if line.startswith('{"event": "ready"'):
                info = json.loads(line)
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    finally:
        sel.close()
    if info is None:
        with open(log_path, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(
            f"kvcache {' '.join(args)} exited with code {proc.returncode} before "
            f"it was ready:\n{tail}"
        )
    sp = ServiceProcess(args[0], proc, info, log_path)
    # NOTE: keep reading stdout so a chatty process never blocks on a full pipe.
    sp._drain = threading.Thread(target=lambda: [None for _ in stdout], daemon=True)
    sp._drain.start()
    return sp


SHM_DIR = "/dev/shm"


def shm_holders() -> dict[str, set[int]]:
    """Every ``/dev/shm`` name some live process maps or holds open -> those pids (read from
    ``/proc``; processes of other users are invisible without privileges). Matched by inode:
    a POSIX semaphore (``sem.mp-*``) is mapped under the temporary name glibc made it under,
    so only its inode ties the mapping to the name."""
    by_inode: dict[int, list[str]] = {}
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return {}
    for name in names:
        try:
            by_inode.setdefault(os.stat(os.path.join(SHM_DIR, name)).st_ino, []).append(name)
        except OSError:
            continue
    holders: dict[str, set[int]] = {}
    prefix = (SHM_DIR + "/").encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        inodes = set()
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    if prefix in line:  # address perms offset dev inode path
                        inodes.add(int(line.split(maxsplit=5)[4]))
            fds = os.listdir(f"/proc/{pid}/fd")
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            fds = []
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM_DIR + "/"):
                    inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                continue
        for inode in inodes:
            for name in by_inode.get(inode, ()):
                holders.setdefault(name, set()).add(pid)
    return holders


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except OSError:
                continue
    return pids


def group_shm(pgid: int) -> tuple[set[int], set[str]]:
    """The live processes of group ``pgid`` and the /dev/shm names they hold."""
    pids = set(group_pids(pgid))
    return pids, {name for name, holders in shm_holders().items() if holders & pids}


def release_shm(pids: set[int], names: set[str], timeout_s: float = 10.0) -> list[str]:
    """Once ``pids`` have exited (their mappings go with them, before anyone reaps them),
    remove those of ``names`` that no live process holds: what processes that were SIGKILLed
    could not unlink themselves. Returns the names removed."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(delay)
        delay = min(delay * 2, 0.2)
    return remove_orphan_shm(names)


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited process waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def remove_orphan_shm(names: set[str]) -> list[str]:
    """Unlink those of ``names`` that still exist and no live process holds (what a SIGKILLed
    process group leaves: it could not unlink its own segments). Returns the names removed."""
    held = shm_holders()
    removed = []
    for name in sorted(names - held.keys()):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            continue
        removed.append(name)
    return removed
