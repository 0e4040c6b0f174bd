"""The node's control socket (node/control.py): a same-host client's lease calls over a Unix
connection instead of gRPC, with the same answers, errors, identities and tenant scoping.
Real node processes with tokens; strangers' connections opened by hand, as an attacker on the
host would."""

from __future__ import annotations

import os
import signal
import socket

import grpc
import numpy as np
import pytest

from clients.node_client import KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from kvstore.shm import socket_address
from plumbing.launch import free_port, start_service
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from rpc.control import HEADER, HELLO, METHOD_IDS, recv_frame, send_frame

from conftest import TEST_LAYOUT
from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import rpc_error, sigstop, wait_until

ADMIN, ALICE, BOB = "admin-token-control", "alice-token-control", "bob-token-control"


def pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, (n, PB), dtype=np.uint8)


def keys(n: int, start: int = 0) -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(NS, b"control"))


@pytest.fixture
def node(start_node):
    return start_node(
        "--token", ADMIN, "--tenant-token", f"{ALICE}=alice", "--tenant-token", f"{BOB}=bob"
    )


def control_name(address: str, token: str) -> str:
    with KVStoreClient(address, token, use_control=False) as c:
        name = c.info().control_socket
    assert name.startswith("@kvcache-control-")
    return name


def stranger(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(socket_address(name))
    return sock


def hello(sock: socket.socket, token: str) -> tuple[int, bytes]:
    send_frame(sock, HELLO, token.encode())
    return recv_frame(sock)


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_lease_calls_go_over_the_control_socket_and_answer_as_grpc_does(node):
    with (
        KVStoreClient(node.address, ALICE) as fast,
        KVStoreClient(node.address, ALICE, use_control=False) as slow,
    ):
        stored = pages(3, 1)
        fast.put(NS, stored, keys=keys(3))
        channel = fast._control
        assert channel is not None and not channel.broken and channel._opened >= 1
        assert slow._control is None
        for c in (fast, slow):
            assert c.lookup(NS, keys=keys(4)).hit_blocks == 3
            with c.acquire(NS, keys=keys(3)) as lease:
                assert all(np.array_equal(lease.page(i), stored[i]) for i in range(3))
        # The same refusals, code and message, both ways.
        unknown = [rpc_error(lambda: c.lookup("nope", keys=keys(1))) for c in (fast, slow)]  # noqa: B023
        short = [rpc_error(lambda: c.allocate(NS, keys=[b"short"])) for c in (fast, slow)]  # noqa: B023
        assert unknown[0] == unknown[1] and unknown[0][0] == grpc.StatusCode.INVALID_ARGUMENT
        assert short[0] == short[1] and short[0][0] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_tenant_cannot_reach_another_tenants_lease_over_the_control_socket(node):
    with KVStoreClient(node.address, ALICE) as alice, KVStoreClient(node.address, BOB) as bob:
        alice.put(NS, pages(2, 2), keys=keys(2))
        assert bob.lookup(NS, keys=keys(2)).hit_blocks == 0  # its keys are scoped to bob
        lease = alice.allocate(NS, keys=keys(2, 10))
        assert bob._control is not None
        stolen = pb.LeaseRequest(namespace=NS, lease_id=lease.lease_id, node_epoch=lease.node_epoch)
        code, _ = rpc_error(lambda: bob._call("Commit", stolen))
        assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)
        code, _ = rpc_error(lambda: bob._call("Abort", stolen))
        assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)
        alice.commit(lease)  # still alice's to end
        assert alice.lookup(NS, keys=keys(2, 10)).hit_blocks == 2


def test_strangers_get_clear_refusals_and_the_node_keeps_serving(node):
    name = control_name(node.address, ADMIN)
    # A wrong token, or none, is refused and the connection closed.
    for token in ("wrong-token", ""):
        with stranger(name) as sock:
            code, message = hello(sock, token)
            assert code == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert b"bearer token" in message
            assert closed(sock)
    # A hello larger than a token is not read (a stranger's buffer), the connection closed.
    with stranger(name) as sock:
        sock.sendall(HEADER.pack(1 << 20, HELLO))
        assert closed(sock)
    # A call before the hello is no hello.
    with stranger(name) as sock:
        send_frame(sock, METHOD_IDS["Lookup"], b"")
        code, _ = recv_frame(sock)
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0] and closed(sock)
    with stranger(name) as sock:
        assert hello(sock, ALICE) == (0, b"")
        # An unknown method, a request that is not one: errors, the connection stays usable.
        send_frame(sock, 200, b"")
        code, message = recv_frame(sock)
        assert code == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"#200" in message
        send_frame(sock, METHOD_IDS["Lookup"], b"\xff\xff\xff")
        code, message = recv_frame(sock)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"Lookup" in message
        request = cpb.BlockSelector(namespace=NS, keys=keys(1))
        send_frame(sock, METHOD_IDS["Lookup"], request.SerializeToString())
        code, payload = recv_frame(sock)
        assert code == 0 and pb.LookupReply.FromString(payload).total_blocks == 1
        # A frame larger than any message: the connection is closed (its stream is lost).
        sock.sendall(HEADER.pack(1 << 31, METHOD_IDS["Lookup"]))
        assert closed(sock)
    with KVStoreClient(node.address, ALICE) as c:
        assert c.lookup(NS, keys=keys(1)).total_blocks == 1


def test_past_the_connection_cap_a_client_goes_on_over_grpc(start_node):
    node = start_node()
    name = control_name(node.address, "")
    held = []
    try:
        for _ in range(64):  # what one user may hold
            sock = stranger(name)
            held.append(sock)
            assert hello(sock, "") == (0, b"")
        with stranger(name) as refused:
            assert closed(refused)
        with KVStoreClient(node.address) as c:
            c.put(NS, pages(1, 3), keys=keys(1))
            assert c._control is not None and c._control.broken
            assert c.lookup(NS, keys=keys(1)).hit_blocks == 1
    finally:
        for sock in held:
            sock.close()


def test_a_client_follows_a_restarted_node_to_its_new_control_socket(tmp_path):
    address = f"127.0.0.1:{free_port('127.0.0.1')}"
    args = ["node", "--listen", address, "--dram", "1MiB", "--layout", TEST_LAYOUT]
    node = start_service(args, log_dir=str(tmp_path))
    try:
        with KVStoreClient(address) as c:
            c.put(NS, pages(2, 4), keys=keys(2))
            first = c._control
            assert first is not None and first._opened >= 1
            node.stop()
            node = start_service(args, log_dir=str(tmp_path))
            # The held connection is dead: the call goes over gRPC to the new node, and the
            # client learns the new socket for the calls after it.
            assert c.lookup(NS, keys=keys(2)).hit_blocks == 0
            c.put(NS, pages(2, 5), keys=keys(2, 20))
            assert c._control is not None and c._control is not first
            assert c._control.name != first.name and not c._control.stale
            assert c.lookup(NS, keys=keys(2, 20)).hit_blocks == 2
    finally:
        node.stop()


def test_a_hung_node_fails_the_call_at_its_deadline_and_the_client_recovers(start_node):
    node = start_node()
    with KVStoreClient(node.address, timeout_s=0.5) as c:
        c.put(NS, pages(1, 6), keys=keys(1))  # over the control socket
        held = c._control
        c._control, c._info = None, None
        held.close()
        c.namespaces()  # learns the socket again (GetInfo): a new channel, no connection yet
        fresh = c._control
        assert fresh is not None and fresh is not held and fresh._opened == 0
        sigstop(node.pid)
        try:
            code, _ = rpc_error(lambda: c.lookup(NS, keys=keys(1)))
        finally:
            os.kill(node.pid, signal.SIGCONT)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED  # once, not once more over gRPC
        assert fresh.broken  # the hello went unanswered: gRPC for a while
        # Resumed: answered again (over gRPC for a while, then the control socket).
        wait_until(lambda: c.lookup(NS, keys=keys(1)).hit_blocks == 1, what="answers again")
