"""The little of ASGI the router speaks (uvicorn's server calls it): a request's headers and
body, a JSON answer, a stream's start and chunks, the client's leaving, and lifespan.

Written straight against the protocol rather than through a web framework: per streamed
completion a framework's request object, dependency resolution, middleware wrapping every
``send`` and a task group watching for the client cost the router a measured share of its
time under load (``kvcache bench router``), for routes that need none of it.
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable, Iterable, Mapping

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

# A request body above this is refused (413) before it is held whole: a prompt of the longest
# contexts served today, as JSON token ids, is a fraction of it.
MAX_BODY_BYTES = 64 << 20
JSON_TYPE = b"application/json"


class BodyTooLarge(Exception):
    pass


def header(scope: Scope, name: bytes) -> bytes:
    """The request header ``name`` (lower case), as sent; b"" if none."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return b""


async def read_body(receive: Receive, limit: int = MAX_BODY_BYTES) -> bytes:
    """The whole request body. ``BodyTooLarge`` past ``limit``; b"" if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""  # http.disconnect: nobody is left to answer
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is over {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def disconnected(receive: Receive) -> None:
    """Returns when the client has closed its connection (its body was read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _headers(
    content_type: bytes | None, headers: Mapping[str, str] | None
) -> list[tuple[bytes, bytes]]:
    out: list[tuple[bytes, bytes]] = [(b"content-type", content_type)] if content_type else []
    if headers:
        out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
    return out


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes | None = JSON_TYPE,
    headers: Mapping[str, str] | None = None,
) -> None:
    start = _headers(content_type, headers)
    start.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": start})
    await send({"type": "http.response.body", "body": body})


async def send_json(
    send: Send, status: int, value: Any, headers: Mapping[str, str] | None = None
) -> None:
    body = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    await send_bytes(send, status, body, JSON_TYPE, headers)


async def start_stream(
    send: Send, status: int, content_type: bytes, headers: Mapping[str, str] | None = None
) -> None:
    """Starts a response whose body follows in chunks (``send_chunk``; chunked encoding)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": _headers(content_type, headers),
        }
    )


async def send_chunk(send: Send, body: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def lifespan(
    receive: Receive, send: Send, on_shutdown: Iterable[Callable[[], Awaitable[None]]]
) -> None:
    """The server's startup and shutdown: nothing to start; ``on_shutdown`` run at the end."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            for step in on_shutdown:
                await step()
            await send({"type": "lifespan.shutdown.complete"})
            return
