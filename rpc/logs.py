"""Logs of every kvcache process: one event per line, as text or JSON (``--log-format``), each
with the process's role and node id and, inside an RPC, its request id.

The request id is the caller's ``x-request-id`` metadata, else the request's own ``request_id``
field (a conductor ``Schedule``), else one made up for the call, so every line an RPC logs can
be grepped together. ``RequestContext`` is set per call by the server's interceptor
(``rpc.server``) and read only when a line is logged: calls that log nothing pay one context
variable.
"""

from __future__ import annotations

import contextvars
import logging
import secrets
import sys
from typing import Any

FORMATS = ("text", "json")


class RequestContext:
    """What a log line says about the RPC it was logged in; the id is made on first use."""

    __slots__ = ("method", "_metadata", "_request", "_id")

    def __init__(self, method: str, metadata: Any, request: Any = None) -> None:
        self.method = method
        self._metadata = metadata
        self._request = request
        self._id: str | None = None

    @property
    def request_id(self) -> str:
        if self._id is None:
            rid = ""
            for key, value in self._metadata or ():
                if key == "x-request-id":
                    rid = str(value)
                    break
            if not rid:
                rid = str(getattr(self._request, "request_id", "") or "")
            self._id = rid[:128] or secrets.token_hex(6)
        return self._id


CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "kvcache_rpc", default=None
)
_identity: dict[str, str] = {"role": "", "node_id": ""}


def set_identity(role: str | None = None, node_id: str | None = None) -> None:
    """Name this process in every later line (the node id is known once its config is read)."""
    if role is not None:
        _identity["role"] = role
    if node_id is not None:
        _identity["node_id"] = node_id


class _Fields(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.role = _identity["role"]
        record.node_id = _identity["node_id"]
        ctx = CURRENT.get()
        record.request_id = ctx.request_id if ctx is not None else ""
        record.rpc = ctx.method.rsplit("/", 1)[-1] if ctx is not None else ""
        return True


def _json_formatter() -> logging.Formatter:
    """python-json-logger: one object per line with ts, level, logger, role, node_id,
    request_id, rpc, msg (and exc_info, the traceback as one string)."""
    from pythonjsonlogger.json import JsonFormatter

    return JsonFormatter(
        "{asctime}{levelname}{name}{role}{node_id}{request_id}{rpc}{message}",
        style="{",
        rename_fields={"asctime": "ts", "levelname": "level", "name": "logger", "message": "msg"},
    )


class TextFormatter(logging.Formatter):
    """``time LEVEL logger [role node_id req=ID rpc]: message`` on one line: a traceback's
    newlines are escaped so that a line is an event."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(where)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        parts = [getattr(record, "role", ""), getattr(record, "node_id", "")]
        rid = getattr(record, "request_id", "")
        if rid:
            parts += [f"req={rid}", getattr(record, "rpc", "")]
        where = " ".join(p for p in parts if p)
        record.where = f" [{where}]" if where else ""
        return super().format(record).replace("\n", "\\n")


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Log to stderr in ``fmt`` ("text" or "json") from ``level`` up; replaces any handlers."""
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_Fields())
    handler.setFormatter(_json_formatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
