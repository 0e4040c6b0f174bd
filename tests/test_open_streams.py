"""Denial of service before authentication: health checking and reflection answer without a
token (load balancers and grpcurl need them), so anyone who reaches a port can open their
streams. Each one used to hold a gRPC worker for as long as the client kept it open; a few dozen
idle ones froze a node, conductor or messenger for every tenant. Real processes with a token and
TLS (rpc/tls.py's local CA, as ``kvcache up --tls`` runs them), streams opened as a stranger's
client would."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto import (
    conductor_pb2,
    conductor_pb2_grpc,
    messenger_pb2,
    messenger_pb2_grpc,
    node_pb2,
    node_pb2_grpc,
)
from rpc.channel import make_channel
from rpc.tls import make_local_ca

from helpers import wait_until

STREAMS = 40  # of each kind, from one address (loopback)
TOKEN = "admin-secret-token"


@pytest.fixture
def secured(tmp_path):
    files = make_local_ca(str(tmp_path / "tls"), [])
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    args = ["--token-file", str(token_file), "--tls-cert", files.cert, "--tls-key", files.key]
    return files.ca_cert, args


def stranger_channel(address: str, ca: str) -> grpc.Channel:
    """A TLS channel of its own (no token): streams on one connection share its window."""
    with open(ca, "rb") as f:
        creds = grpc.ssl_channel_credentials(root_certificates=f.read())
    return grpc.secure_channel(address, creds, options=[("grpc.use_local_subchannel_pool", 1)])


def open_idle_streams(address: str, ca: str, never: threading.Event) -> tuple[list, list, list]:
    """STREAMS reflection streams that send one request and then nothing, and STREAMS
    Health.Watch streams that are never read past their first status; returns (channels,
    reflections, watches)."""

    def one_then_silence():
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        never.wait(120)

    # Connected first (a TLS handshake each): opened while others handshake, the first
    # streams could be cut idle before the last arrive, and a later one take a freed slot.
    channels = [stranger_channel(address, ca) for _ in range(STREAMS)]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=30)
    reflections, watches = [], []
    for channel in channels:
        reflections.append(
            reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                one_then_silence()
            )
        )
        watches.append(
            health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        )
    return channels, reflections, watches


def first_answer(call) -> grpc.StatusCode:
    try:
        next(call)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def ended(call) -> grpc.StatusCode | None:
    """How a stream ended (None: it is still open); reads what it was sent first."""
    if call.running():
        return None
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def assert_served_while_streams_open(address: str, ca: str, call_api) -> None:
    never = threading.Event()
    channels, reflections, watches = open_idle_streams(address, ca, never)
    pool = futures.ThreadPoolExecutor(16)
    try:
        # Every stream reached the server: it answered its first message, or refused it.
        # (Before: the streams past the gRPC workers queued behind the others, unanswered.)
        first = [pool.submit(first_answer, c) for c in reflections + watches]
        wait_until(lambda: all(f.done() for f in first), what="every stream answered or refused")
        with make_channel(address, TOKEN, ca) as channel:
            for _ in range(3):
                t0 = time.monotonic()
                call_api(channel, 2.0)  # DEADLINE_EXCEEDED before: no worker was left
                assert time.monotonic() - t0 < 2.0
        # The streams past the cap were refused at once; the rest are cut once idle for
        # --open-stream-timeout (reflection) or past 4 x that (Health.Watch).
        codes = wait_until(
            lambda: (lambda cs: cs if None not in cs else None)(
                [ended(c) for c in reflections + watches]
            ),
            timeout_s=30,
            what="every unauthenticated stream to end",
        )
        counts = {code: codes.count(code) for code in set(codes)}
        assert set(counts) == {
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        }, counts
        assert counts[grpc.StatusCode.RESOURCE_EXHAUSTED] >= 2 * STREAMS - 20, counts
    finally:
        never.set()
        for call in reflections + watches:
            call.cancel()
        for channel in channels:
            channel.close()
        pool.shutdown(wait=False, cancel_futures=True)


def test_idle_open_streams_do_not_freeze_a_node(start_node, secured):
    ca, args = secured
    node = start_node(*args, "--open-stream-timeout", "1")

    def call(channel, timeout):
        assert (
            node_pb2_grpc.NodeServiceStub(channel)
            .GetInfo(node_pb2.GetInfoRequest(), timeout=timeout)
            .node_id
        )

    assert_served_while_streams_open(node.address, ca, call)


def test_idle_open_streams_do_not_freeze_a_conductor(start_kvcache, secured):
    ca, args = secured
    conductor = start_kvcache(
        "conductor", "--listen", "127.0.0.1:0", *args, "--open-stream-timeout", "1"
    )

    def call(channel, timeout):
        conductor_pb2_grpc.ConductorServiceStub(channel).ListNodes(
            conductor_pb2.ListNodesRequest(), timeout=timeout
        )

    assert_served_while_streams_open(conductor.address, ca, call)


def test_idle_open_streams_do_not_freeze_a_messenger(start_node, start_kvcache, secured):
    ca, args = secured
    node = start_node(*args)
    messenger = start_kvcache(
        "messenger", "--node", node.address, "--node-tls-ca", ca, "--listen", "127.0.0.1:0",
        *args, "--open-stream-timeout", "1",
    )  # fmt: skip

    def call(channel, timeout):
        assert (
            messenger_pb2_grpc.MessengerServiceStub(channel)
            .GetInfo(messenger_pb2.MessengerInfoRequest(), timeout=timeout)
            .data_address
        )

    assert_served_while_streams_open(messenger.address, ca, call)
