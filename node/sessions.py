"""Sessions: the node learns at once that a same-host client died, and ends its leases then.

A write lease's pages are quarantined after its deadline because a same-host writer fills shared
memory directly: one whose fate is unknown may still be writing. A writer known to be dead is not,
so its pages need no quarantine. Knowing it takes a held connection: a client that maps the node's
shared memory connects to the node's *session socket* (abstract Unix socket, named in GetInfo)
and keeps the connection for its life; the node answers with a session id, which the client sends
with Allocate and Acquire. The kernel names the connecting process (SO_PEERCRED), and the node
holds a pidfd on it.

A session is dead when its connection is closed *and* its process has exited (the pidfd says so):
no thread of it, nor a forked child holding the inherited connection, can write any more. Its
leases end at once (``Node.holders_gone``): live write leases are aborted and their pages freed
(fenced by their generation, as any freed page), expired ones leave quarantine, read leases are
released. When the node cannot see the process (another PID namespace: SO_PEERCRED says pid 0;
or no pidfd support) the closed connection alone says the client is gone. A connection closed by a
live process (a client closed with leases open) waits for that process's exit; a lease taken
without a session keeps the deadline and the quarantine.

A session id only ever ties the *caller's* leases to a connection: presenting another process's
id can only end one's own leases early, never anyone else's.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

from kvstore.shm import SESSION_HELLO, socket_address

log = logging.getLogger(__name__)
MAX_SESSIONS = 256  # each holds two descriptors (connection, pidfd); more are refused
# Anyone on the host can connect: one user (uid) may hold this many, so another user's flood
# cannot take every session of the node.
MAX_SESSIONS_PER_UID = 64
MAX_TOMBSTONES = 4096  # ids of dead sessions kept: an Allocate still in flight ends at once
_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(eq=False)
class _Session:
    sid: bytes
    pid: int
    conn: socket.socket | None
    pidfd: int | None
    leases: set[Hashable] = field(default_factory=set)
    uid: int = -1

    @property
    def gone(self) -> bool:
        """Connection closed and the process exited (or not visible: the connection says it)."""
        return self.conn is None and self.pidfd is None


class Sessions:
    """The session socket, the live sessions and the leases each holds.

    ``on_gone(pid, keys)`` runs on the watcher thread when a session dies, with the keys its
    leases were attached under (``attach``)."""

    def __init__(self, on_gone: Callable[[int, list[Hashable]], None]) -> None:
        self._on_gone = on_gone
        self.socket_name = f"@kvcache-session-{os.getpid()}-{secrets.token_hex(8)}"
        self._live: dict[bytes, _Session] = {}
        self._dead: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(socket_address(self.socket_name))
        self._server.listen(64)
        self._server.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._watch, name="sessions", daemon=True)
        self._thread.start()

    # ---- leases ----------------------------------------------------------------------------

    def attach(self, sid: bytes, key: Hashable) -> bool:
        """Tie a lease to session ``sid``. False when that session is already dead: the caller
        ends the lease now. An unknown id (another node's, a forged one) ties nothing."""
        with self._lock:
            session = self._live.get(sid)
            if session is not None:
                session.leases.add(key)
                return True
            return sid not in self._dead

    def detach(self, sid: bytes, key: Hashable) -> None:
        """The lease ended on its own (commit, abort, release, expiry)."""
        with self._lock:
            session = self._live.get(sid)
            if session is not None:
                session.leases.discard(key)

    def count(self) -> int:
        with self._lock:
            return len(self._live)

    # ---- the watcher ------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(timeout=0.25)
            except OSError:  # closed under us at shutdown
                return
            for key, _ in events:
                if key.data is None:
                    self._accept()
                    continue
                kind, session = key.data
                if kind == "conn":
                    self._on_conn(session)
                else:
                    self._on_exit(session)

    def _accept(self) -> None:
        try:
            conn, _ = self._server.accept()
        except BlockingIOError:
            return
        except OSError as e:  # EMFILE and the like: the client goes without a session
            log.warning("session socket: cannot accept (%s)", e)
            self._stop.wait(0.1)  # NOTE: the listener stays readable: do not spin on it
            return
        sid, pidfd = b"", None
        try:
            pid, uid = peer_of(conn)
            with self._lock:
                full = len(self._live) >= MAX_SESSIONS
                mine = sum(1 for s in self._live.values() if s.uid == uid)
            if full or mine >= MAX_SESSIONS_PER_UID:
                log.warning(
                    "session socket: %s; refused one (pid %d, uid %d)",
                    f"{MAX_SESSIONS} sessions open"
                    if full
                    else f"uid {uid} holds {MAX_SESSIONS_PER_UID} sessions",
                    pid,
                    uid,
                )
                conn.close()
                return
            pidfd = _pidfd(pid)
            sid = secrets.token_bytes(16)
            session = _Session(sid, pid, conn, pidfd, uid=uid)
            # NOTE: live before the client learns its id: its first Allocate may arrive on
            # another thread the moment the hello is out, and an unknown id ties nothing.
            with self._lock:
                self._live[sid] = session
            # A fresh socket's buffer takes this one short line; never blocks.
            conn.sendall(SESSION_HELLO + b" " + sid.hex().encode() + b"\n")
            conn.setblocking(False)
        except OSError as e:
            log.info("session socket: a client left during its hello: %s", e)
            with self._lock:
                self._live.pop(sid, None)
            if pidfd is not None:
                os.close(pidfd)
            conn.close()
            return
        self._sel.register(conn, selectors.EVENT_READ, ("conn", session))
        if pidfd is not None:
            self._sel.register(pidfd, selectors.EVENT_READ, ("pid", session))

    def _on_conn(self, session: _Session) -> None:
        """Readable: closed (or the client broke the protocol by sending; it stays its own)."""
        conn = session.conn
        assert conn is not None
        try:
            if conn.recv(64):
                log.warning("session socket: pid %d sent data; closing its session", session.pid)
        except BlockingIOError:
            return
        except OSError:
            pass
        self._sel.unregister(conn)
        conn.close()
        session.conn = None
        if session.pidfd is not None:
            log.info(
                "session of pid %d closed; its %d leases end when the process exits",
                session.pid,
                len(session.leases),
            )
        self._check(session)

    def _on_exit(self, session: _Session) -> None:
        assert session.pidfd is not None
        self._sel.unregister(session.pidfd)
        os.close(session.pidfd)
        session.pidfd = None
        self._check(session)

    def _check(self, session: _Session) -> None:
        if not session.gone:
            return  # connection held by another process (a fork), or process still running
        with self._lock:
            self._live.pop(session.sid, None)
            self._dead[session.sid] = None
            while len(self._dead) > MAX_TOMBSTONES:
                self._dead.popitem(last=False)
            keys, session.leases = list(session.leases), set()
        if keys:
            try:
                self._on_gone(session.pid, keys)
            except Exception:  # noqa: BLE001 - keep watching the other sessions; log loudly
                log.exception("ending the leases of dead pid %d failed", session.pid)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        with self._lock:
            sessions, self._live = list(self._live.values()), {}
        for session in sessions:
            if session.conn is not None:
                session.conn.close()
            if session.pidfd is not None:
                os.close(session.pidfd)
        self._sel.close()
        self._server.close()


def peer_of(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of a Unix connection's peer, as the kernel names it (SO_PEERCRED; pid 0 for
    a peer in a PID namespace this process cannot see). Raises OSError."""
    pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return pid, uid


def _pidfd(pid: int) -> int | None:
    """A pidfd on ``pid``, or None: pid 0 (the peer lives in a PID namespace we cannot see), or
    no pidfd support (Linux < 5.3). NOTE: opened after the connect; had the client died and its
    pid been reused meanwhile, the closed connection still gates the session's end."""
    if pid <= 0 or not hasattr(os, "pidfd_open"):
        return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None
