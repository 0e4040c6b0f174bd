"""A fork server for the test engines: one process per test process imports vLLM once (about
10 s of CPU on this machine), and every engine after that is a fork of it, started in the time
its engine takes to build. The suite starts dozens of engines; their imports were most of its
CPU time.

    proc = spawn(os.environ | {...}, stdin_fd, stdout_fd, stderr_fd)  # a Popen-like handle
    proc.pid, proc.poll(), proc.wait(timeout), proc.kill()

A forked engine is a process group of its own (what ``start_new_session`` gives, but in the
test's session), with the environment and standard streams it was given, running
``vllm_driver.main``.
Its exit status reaches the test process through the server, which reaps it. The server ends
when the test process does (its stdin closes); it starts no thread, so forking it is safe.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
FLAG = "--zygote"  # in the server's command line: tests/leftovers.py spares it
# What an engine imports on its way up, imported once in the server instead.
PRELOAD = (
    "vllm",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.lora.request",
    "vllm.model_executor.models.llama",
    "vllm.v1.worker.cpu_model_runner",
    "clients.vllm_connector",
)

_lock = threading.Lock()
_server: tuple[subprocess.Popen, str] | None = None


class Forked:
    """A forked engine, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn  # the server writes the exit status here, then closes it

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"engine {self.pid}", timeout or 0)
            self._collect()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not reaped: the pid is still this engine's
            os.kill(self.pid, signal.SIGKILL)

    def _collect(self) -> None:
        data = b""
        while chunk := self._conn.recv(4096):
            data += chunk
        self._conn.close()
        # No status: the server died before reaping it (the engine died with it).
        self.returncode = json.loads(data)["exit"] if data else -signal.SIGKILL


def spawn(env: dict[str, str], stdin: int, stdout: int, stderr: int) -> Forked:
    """Fork an engine from this process's server (started on first use) with ``env`` and the
    given descriptors as its standard streams; the caller closes its copies of them."""
    # The server imports with this process's environment (and the engine's PYTHONPATH), not
    # with what one engine's test set for itself.
    path = _ensure_server({**os.environ, "PYTHONPATH": env.get("PYTHONPATH", "")})
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    msg = json.dumps({"env": env, "cwd": os.getcwd()}).encode()
    socket.send_fds(conn, [msg + b"\n"], [stdin, stdout, stderr])
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = conn.recv(64)
        if not chunk:
            raise RuntimeError(f"the engine fork server failed: see {path}.log")
        reply += chunk
    return Forked(int(json.loads(reply)["pid"]), conn)


def _ensure_server(env: dict[str, str]) -> str:
    global _server
    with _lock:
        if _server is not None and _server[0].poll() is None:
            return _server[1]
        work = tempfile.mkdtemp(prefix="kvt-zygote-")
        path = os.path.join(work, "sock")
        log = open(path + ".log", "w")
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), FLAG, path],
            stdin=subprocess.PIPE,  # closed when this process exits: the server exits then
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
        )
        log.close()
        assert proc.stdout is not None
        if proc.stdout.readline() != b"ready\n":
            proc.wait()
            raise RuntimeError(f"the engine fork server did not start: see {path}.log")
        _server = (proc, path)
        return path


# ---- the server's side --------------------------------------------------------------------------


def _serve(path: str) -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    children: dict[int, socket.socket] = {}
    os.write(1, b"ready\n")
    while True:
        ready = select.select([listener, wake_r, 0], [], [])[0]
        if 0 in ready and not os.read(0, 4096):
            # The test process is gone (its engines end with their stdin).
            listener.close()
            for name in (path, path + ".log"):
                os.unlink(name)
            os.rmdir(os.path.dirname(path))
            return
        if wake_r in ready:
            os.read(wake_r, 4096)
            _reap(children)
        if listener in ready:
            conn, _ = listener.accept()
            try:
                pid = _fork(conn, [listener, wake_r, wake_w, *children.values()])
            except (OSError, ValueError) as e:  # a bad request fails its caller, not the server
                print(f"refused a request: {e!r}", file=sys.stderr, flush=True)
                conn.close()
                continue
            if pid:
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


def _reap(children: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass  # the test process stopped waiting for it
            conn.close()


def _fork(conn: socket.socket, close: list[Any]) -> int:
    # The descriptors come with the first bytes (a plain recv would drop them).
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not msg.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            raise ConnectionError("the request was cut")
        msg += chunk
    if len(fds) != 3:
        raise ConnectionError(f"3 descriptors expected, {len(fds)} came")
    request = json.loads(msg)
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        return pid
    # The engine: nothing of the server's survives but what it imported.
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # NOTE: a group of its own, in the test's session: a session of its own is an
        # autogroup of its own too (kernel.sched_autogroup_enabled), and a TP engine's two
        # spinning ranks, pinned one per core, then took both cores from the nodes and
        # messengers of the test's session for 10 s and more (their leases lapsed, pulls
        # passed their deadlines) whenever anything else of that session was busy.
        os.setpgid(0, 0)
        for i, fd in enumerate(fds):
            os.dup2(fd, i)
            os.close(fd)
        for c in [*close, conn]:
            if isinstance(c, socket.socket):
                c.close()
            else:
                os.close(c)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        import vllm_driver

        vllm_driver.main()
        code = 0
    except BaseException:  # noqa: BLE001 - the engine's end: reported in its stderr
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[2])
