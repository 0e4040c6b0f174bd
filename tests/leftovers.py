"""What a test run must not leave behind, found the way an operator would find it.

- **Processes.** Every process the run starts inherits ``KVTEST_SESSION=<token>`` in its
  environment (conftest sets it before any test), through ``subprocess``, ``ip netns exec``,
  double forks and vLLM's spawned workers alike; a live process carrying this run's token
  after its module finished is a leftover, wherever it was reparented.
- **Shared memory.** A ``/dev/shm`` entry made during a module that no live process maps or
  holds open is a leftover (e.g. the ``psm_*`` segments of a SIGKILLed vLLM engine).
  Segments that another process still holds are that process's business. /dev/shm names
  carry no owner: another run of the suite on the same machine that orphans a segment during
  this module's run is blamed here too (CI runs one suite at a time).
- **Network namespaces and links** whose name starts with this run's prefix (``net_prefix``:
  the test helpers name theirs with it), so that another run on the same machine is never
  blamed.

``conftest`` checks after every test module (its fixtures are torn down by then) and once at
the end of the session; it reports, removes what it found, and fails the run. Under
pytest-xdist each worker checks its own processes and namespaces after each module, and the
controller checks shared memory once every worker is done.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from dataclasses import dataclass, field

SESSION_ENV = "KVTEST_SESSION"
SHM_DIR = "/dev/shm"
NETNS_DIR = "/run/netns"
# Children of the test process that live as long as it does and exit with it.
_OWN_HELPERS = (
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
    "vllm_zygote.py --zygote",  # tests/vllm_zygote.py: the engines' fork server
)


def session_token() -> str:
    """This run's token (made once, inherited by every child through the environment)."""
    token = os.environ.get(SESSION_ENV)
    if not token:
        token = os.environ[SESSION_ENV] = secrets.token_hex(6)
    return token


def xdist_worker() -> str | None:
    """The pytest-xdist worker this process is (``gw0``, ``gw1``, ...), None when not one."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def start_worker() -> None:
    """An xdist worker is a run of its own: a token (and so a net prefix) of its own, since the
    one it inherited from the controller would make each worker's processes the other's
    leftovers. Workers' prefixes differ in their first character, never by chance alone."""
    worker = xdist_worker()
    if worker and os.environ.get(SESSION_ENV + "_WORKER") != worker:
        index = int(worker.removeprefix("gw") or 0)
        os.environ[SESSION_ENV] = f"{index:x}{secrets.token_hex(6)}"[:12]
        os.environ[SESSION_ENV + "_WORKER"] = worker


def net_prefix() -> str:
    """The first characters of every network namespace and link name this run makes: short,
    since a link name with its suffix ("-br", "-h12") must fit Linux's 15 characters."""
    return "t" + session_token()[:3]


@dataclass
class Found:
    processes: list[str] = field(default_factory=list)
    shm: list[str] = field(default_factory=list)
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.processes or self.shm or self.netns or self.links)

    def report(self) -> str:
        lines = []
        for what, items in (
            ("processes", self.processes),
            ("/dev/shm entries nobody holds", self.shm),
            ("network namespaces", self.netns),
            ("network links", self.links),
        ):
            if items:
                lines.append(f"{len(items)} {what}: " + "; ".join(items[:10]))
        return "\n".join(lines)


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone meanwhile, or a zombie / kernel thread
        return b""


def _ppid(pid: int) -> int:
    stat = _read(f"/proc/{pid}/stat")
    try:
        return int(stat.rsplit(b")", 1)[1].split()[1])
    except (IndexError, ValueError):
        return 0


def session_processes(token: str) -> dict[int, str]:
    """Live processes (not zombies) of this run other than the test process and its own
    helpers: pid -> command line."""
    me = os.getpid()
    marker = f"{SESSION_ENV}={token}".encode()
    found = {}
    for pid in _pids():
        if pid == me:
            continue
        if marker not in _read(f"/proc/{pid}/environ").split(b"\0"):
            continue
        cmdline = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")
        if not cmdline:
            continue  # a zombie: exited, waiting for its parent to reap it
        if _ppid(pid) == me and any(h in cmdline for h in _OWN_HELPERS):
            continue
        found[pid] = cmdline.strip()
    return found


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except OSError:
        return set()


def held_shm() -> set[str]:
    """Names in /dev/shm that some live process maps or holds open, matched by inode: a
    POSIX semaphore (``sem.mp-*``) is mapped under the temporary name glibc created it as."""
    names: dict[int, list[str]] = {}
    for name in shm_entries():
        try:
            names.setdefault(os.stat(os.path.join(SHM_DIR, name)).st_ino, []).append(name)
        except OSError:
            continue
    prefix = (SHM_DIR + "/").encode()
    inodes = set()
    for pid in _pids():
        for line in _read(f"/proc/{pid}/maps").splitlines():
            if prefix in line:  # address perms offset dev inode path
                fields = line.split(maxsplit=5)
                if len(fields) > 4 and fields[4].isdigit():
                    inodes.add(int(fields[4]))
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(SHM_DIR + "/"):
                    inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
            except OSError:
                continue
    return {n for inode in inodes for n in names.get(inode, ())}


def netns_names(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(NETNS_DIR) if n.startswith(prefix))
    except OSError:
        return []


def link_names(prefix: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir("/sys/class/net") if n.startswith(prefix))
    except OSError:
        return []


@dataclass
class Baseline:
    """What was there before the run: only what appears later can be the run's."""

    token: str
    shm: set[str]
    # /dev/shm names carry no owner: beside another worker of the same run, an entry that
    # worker orphans for a moment would be blamed (and removed) here. Workers leave shared
    # memory to the controller's check at the end of the run.
    check_shm: bool = True

    @classmethod
    def take(cls) -> "Baseline":
        return cls(session_token(), shm_entries(), check_shm=xdist_worker() is None)

    def find(self, grace_s: float = 10.0) -> Found:
        """What is left now; processes still on their way out get ``grace_s`` to finish."""
        deadline = time.monotonic() + grace_s
        found = self._find()
        while found.processes and time.monotonic() < deadline:
            time.sleep(0.1)
            found = self._find()
        return found

    def _find(self) -> Found:
        found = Found()
        found.processes = [
            f"{pid} {cmd[:160]}" for pid, cmd in session_processes(self.token).items()
        ]
        new = shm_entries() - self.shm if self.check_shm else set()
        if new:
            held = held_shm()
            # A name the run made and nobody holds. One another process made a moment ago may
            # not be held yet (a semaphore between its creator and the child that opens it):
            # each gets a second look a second later.
            orphans = sorted(n for n in new if n not in held)
            if orphans:
                time.sleep(1.0)
                held = held_shm()
                orphans = sorted(n for n in orphans if n not in held and _exists(n))
            found.shm = orphans
        found.netns = netns_names(net_prefix())
        found.links = link_names(net_prefix())
        return found

    def clean(self, found: Found) -> None:
        """Remove what ``find`` found, so one test's leftovers do not fail the next module."""
        pids = [int(p.split()[0]) for p in found.processes]
        for ns in found.netns:
            pids += _netns_pids(ns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for name in found.shm:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
        for link in found.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for ns in found.netns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.shm -= set(found.shm)


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _netns_pids(ns: str) -> list[int]:
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in r.stdout.split() if p.isdigit()]
