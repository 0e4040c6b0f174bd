"""A bare gRPC server serving only health checking and reflection: the floor of one unary call.

``python -m bench.micro.rpc_floor sync|aio [--workers N]`` prints the ready line every kvcache
server prints and serves until SIGTERM. ``sync`` is built exactly as the role servers are
(``rpc.server.make_server``: a thread pool, the auth interceptor, the channel options); ``aio`` is
a ``grpc.aio`` server with the same options, health and reflection (one event loop, no pool).
``kvcache bench conductor`` times an empty health ``Check`` on both next to the conductor's own,
which shows what the server kind itself costs per call.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer as AsyncHealthServicer
from grpc_reflection.v1alpha import reflection

from rpc.channel import CHANNEL_OPTIONS
from rpc.server import (
    Auth,
    add_health_and_reflection,
    announce_ready,
    bind,
    make_server,
    wait_for_signal,
)

KINDS = ("sync", "aio")


def serve_sync(listen: str, workers: int) -> None:
    server = make_server(Auth(), max_workers=workers)
    add_health_and_reflection(server, [])
    port = bind(server, listen)
    server.start()
    address = f"{listen.rsplit(':', 1)[0]}:{port}"
    wait_for_signal(
        lambda: server.stop(0).wait(),
        on_ready=lambda: announce_ready("floor-sync", address=address, pid=os.getpid()),
    )


async def serve_aio(listen: str) -> None:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    health = AsyncHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    announce_ready("floor-aio", address=f"{listen.rsplit(':', 1)[0]}:{port}", pid=os.getpid())
    await stop.wait()
    await server.stop(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.rpc_floor", description=__doc__)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--workers", type=int, default=8, help="thread pool of the sync server")
    args = parser.parse_args(argv)
    if args.kind == "sync":
        serve_sync(args.listen, args.workers)
    else:
        asyncio.run(serve_aio(args.listen))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
