"""A megabyte-long name comes back short from every service (the node's own test is in
test_node_server.py): an error that echoed it whole would not fit in gRPC's status metadata, and
the caller would get RESOURCE_EXHAUSTED instead of the error that says what to fix."""

from __future__ import annotations

import grpc

from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from proto import messenger_pb2 as mpb
from proto import messenger_pb2_grpc as mpbg
from rpc.channel import make_channel

from conftest import TEST_NAMESPACE
from helpers import rpc_error

MEGA = "n" * (1 << 20)
SHORT = 400  # characters: the message says what is wrong, with the name cut short


def short(call, code: grpc.StatusCode, says: str) -> None:
    got, msg = rpc_error(call)
    assert got == code and says in msg, (got, msg[:200])
    assert len(msg) < SHORT, len(msg)
    assert "(1048576 chars)" in msg  # the name is echoed, cut short


def test_the_conductor_echoes_long_names_short(start_kvcache):
    c = start_kvcache("conductor", "--listen", "127.0.0.1:0")
    stub = pbg.ConductorServiceStub(make_channel(c.address))

    def schedule(namespace: str = TEST_NAMESPACE, request_id: str = "r1") -> pb.ScheduleRequest:
        return pb.ScheduleRequest(
            request_id=request_id,
            blocks=cpb.BlockSelector(namespace=namespace, token_ids=list(range(32))),
        )

    # Namespaces: Schedule, ScheduleBatch, Locate.
    short(
        lambda: stub.Schedule(schedule(MEGA), timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        "no registered node serves namespace 'nnnn",
    )
    short(
        lambda: stub.Locate(cpb.BlockSelector(namespace=MEGA, keys=[b"k" * 16]), timeout=10),
        grpc.StatusCode.FAILED_PRECONDITION,
        "no registered node serves namespace",
    )
    batch = stub.ScheduleBatch(pb.ScheduleBatchRequest(requests=[schedule(MEGA)]), timeout=10)
    (outcome,) = batch.outcomes
    assert outcome.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert len(outcome.message) < SHORT and "(1048576 chars)" in outcome.message
    # Node ids: RegisterNode, Heartbeat, UnregisterNode.
    short(
        lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(node=pb.NodeDescriptor(node_id=MEGA, address="127.0.0.1:1")),
            timeout=10,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "must be 1-128 characters",
    )
    for call in (
        lambda: stub.Heartbeat(pb.HeartbeatRequest(node_id=MEGA), timeout=10),
        lambda: stub.UnregisterNode(pb.UnregisterNodeRequest(node_id=MEGA), timeout=10),
    ):
        short(call, grpc.StatusCode.INVALID_ARGUMENT, "must be 1-128 characters")
    # A layout's dtype, in a registration.
    layout = cpb.Layout(model="m", num_layers=1, kv_heads=1, head_dim=1, dtype=MEGA)
    short(
        lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(
                node=pb.NodeDescriptor(node_id="n1", address="127.0.0.1:1", layouts=[layout])
            ),
            timeout=10,
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "is not supported",
    )
    # Request ids: longer than Schedule takes, so never scheduled; no echo needed at all.
    for call in (
        lambda: stub.Schedule(schedule(request_id=MEGA), timeout=10),
        lambda: stub.Complete(pb.CompleteRequest(request_id=MEGA), timeout=10),
    ):
        code, msg = rpc_error(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "longer than 256" in msg
        assert len(msg) < SHORT
    assert c.alive()


def test_the_messenger_echoes_long_names_short(start_node, start_kvcache):
    node = start_node()
    m = start_kvcache("messenger", "--node", node.address)
    stub = mpbg.MessengerServiceStub(make_channel(m.address))

    def submit(namespace=TEST_NAMESPACE, source="127.0.0.1:1", source_data=""):
        entry = mpb.TransferEntry(key=b"k" * 16, source=source, source_data=source_data)
        return lambda: stub.SubmitTransfer(
            mpb.SubmitTransferRequest(namespace=namespace, entries=[entry]), timeout=10
        )

    short(submit(namespace=MEGA), grpc.StatusCode.INVALID_ARGUMENT, "is not served by")
    short(submit(source=MEGA), grpc.StatusCode.INVALID_ARGUMENT, "source must be")
    short(submit(source_data=MEGA), grpc.StatusCode.INVALID_ARGUMENT, "must be host:port")
    for call in (
        lambda: stub.TransferStatus(mpb.TransferStatusRequest(batch_id=MEGA), timeout=10),
        lambda: stub.Cancel(mpb.CancelRequest(batch_id=MEGA), timeout=10),
    ):
        short(call, grpc.StatusCode.NOT_FOUND, "no transfer batch")
    assert m.alive()
