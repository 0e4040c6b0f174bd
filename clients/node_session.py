"""A same-host client's session with its node (node/sessions.py): one held Unix connection per
client, whose id goes with Allocate and Acquire, so that the node ends this process's leases as
soon as it is gone, instead of at their deadline plus a quarantine."""

from __future__ import annotations

import logging
import socket
import threading

from kvstore.errors import StorageError
from kvstore.shm import open_session

log = logging.getLogger(__name__)


class NodeSession:
    """The session with the node process whose session socket was last asked for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._name = ""
        self._conn: socket.socket | None = None
        self._sid = b""
        self._tried = False

    def id_for(self, name: str) -> bytes:
        """The session id at socket ``name`` (connected on first use and held until ``close``),
        or b"" when there is none: no socket named (an older node), or none reachable (another
        network namespace), or refused. A new name (the node restarted) replaces the session."""
        with self._lock:
            if self._tried and self._name == name:
                return self._sid
        conn: socket.socket | None = None
        sid = b""
        if name:
            try:
                conn, sid = open_session(name)
            except StorageError as e:
                log.info("%s; this client's leases wait for their deadline", e)
        with self._lock:
            if self._tried and self._name == name:  # another thread got there first
                if conn is not None:
                    conn.close()
                return self._sid
            old = self._conn
            self._name, self._conn, self._sid, self._tried = name, conn, sid, True
        if old is not None:
            old.close()  # the session with a node process that is gone
        return sid

    def close(self) -> None:
        """Leases still open then end when this process exits (or at their deadline)."""
        with self._lock:
            conn, self._conn, self._sid, self._tried = self._conn, None, b"", False
        if conn is not None:
            conn.close()
