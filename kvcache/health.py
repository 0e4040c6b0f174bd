"""``kvcache health ADDR``: one gRPC health check (``grpc.health.v1``), for container health
checks and scripts. Exit 0 when the server answers SERVING, else 1 with the reason on stderr
(Docker's HEALTHCHECK reads 1 as unhealthy; it reserves other codes)."""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rpc.channel import make_channel


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="host:port of a kvcache node, messenger or conductor")
    parser.add_argument(
        "--service",
        default="",
        help="a service name, e.g. kvcache.v1.NodeService (default: the whole server)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for the answer (default 3)"
    )
    parser.add_argument("--tls-ca", default=None, help="CA certificate (PEM) of a TLS server")


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise SystemExit("kvcache health: --timeout must be positive")
    request = health_pb2.HealthCheckRequest(service=args.service)
    try:
        with make_channel(args.address, tls_ca_file=args.tls_ca) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
    except grpc.RpcError as e:
        print(f"{args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    except OSError as e:  # the CA file
        print(f"kvcache health: {e}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.address}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
