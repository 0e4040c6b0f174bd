"""The messengers' data ports as an attacker meets them: a cluster from ``kvcache up --tls`` (its
data ports must speak TLS and take a data-plane credential, never the admin token), and a
messenger with a token whose connection slots a stranger tries to hold before saying HELLO."""

from __future__ import annotations

import json
import os
import socket
import ssl

import numpy as np
import pytest

from clients.messenger_client import MessengerClient
from clients.node_client import KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from messenger.data_security import derive_data_token
from messenger.frames import (
    HEADER_BYTES,
    Kind,
    Status,
    checksum,
    pack_header,
    recv_exact,
    unpack_header,
)
from messenger.identity import Identity
from messenger.tcp import TcpConfig, TcpTransport, Unauthenticated, hello
from proto import messenger_pb2 as mpb

from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import kvcache_cli, wait_until


def hello_frame(token: str) -> bytes:
    body = token.encode()
    return pack_header(Kind.HELLO, length=len(body), checksum_=checksum(body)) + body


def answer(sock: socket.socket) -> tuple[Kind, Status, str] | None:
    """The frame the data port answers a HELLO with, or None when it hung up instead."""
    buf = bytearray(HEADER_BYTES)
    try:
        recv_exact(sock, memoryview(buf))
    except (OSError, ConnectionError):
        return None
    h = unpack_header(buf)
    body = bytearray(h.length)
    recv_exact(sock, memoryview(body))
    return h.kind, h.status, body.decode()


@pytest.fixture
def tls_cluster(tmp_path):
    state_dir = tmp_path / "state"
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\nstate_dir = "{state_dir}"\n\n[defaults]\ndram = "32MiB"\n')
    up = kvcache_cli("up", "--config", str(config), "--detach", "--tls")
    assert up.returncode == 0, up.stdout + up.stderr
    assert "TLS on every link" in up.stdout
    with open(state_dir / "cluster.json") as f:
        state = json.load(f)
    yield state
    down = kvcache_cli("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stdout + down.stderr


@pytest.mark.slow
def test_data_ports_of_a_tls_cluster_speak_tls_and_refuse_the_admin_token(tls_cluster):
    state = tls_cluster
    ca, admin = state["tls_ca"], state["token"]
    data_token_file = os.path.join(state["state_dir"], "data-token")
    assert os.stat(data_token_file).st_mode & 0o077 == 0
    with open(data_token_file) as f:
        data_token = f.read().strip()
    assert data_token and data_token != admin
    a, b = state["nodes"][0], state["nodes"][1]
    host, port = a["data_address"].rsplit(":", 1)

    # Plain TCP, as every peer spoke before: the admin token in clear gets no answer.
    with socket.create_connection((host, int(port)), timeout=10) as plain:
        plain.sendall(hello_frame(admin))
        assert answer(plain) is None

    ctx = ssl.create_default_context(cafile=ca)  # the cluster's CA, the address's name
    # TLS, verified; the admin token is not the data port's credential (the port's proof is
    # not one made with it, so the puller stops before it proves anything itself)...
    with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10),
                         server_hostname=host) as tls:  # fmt: skip
        with pytest.raises(Unauthenticated):
            hello(tls, bytearray(HEADER_BYTES), admin)
    # ...the data token is.
    with ctx.wrap_socket(socket.create_connection((host, int(port)), timeout=10),
                         server_hostname=host) as tls:  # fmt: skip
        hello(tls, bytearray(HEADER_BYTES), data_token)

    # The messengers pull from each other over it: pages put on node A arrive whole on node B.
    with KVStoreClient(a["address"], token=admin, tls_ca_file=ca) as a_client:
        info = a_client.info().namespaces[0]
        ns, page_bytes = info.namespace, info.page_bytes
        keys = keys_from_block_ids(list(range(8)), root_key(ns, b"tls-data-port"))
        pages = np.random.default_rng(3).integers(0, 256, (8, page_bytes), dtype=np.uint8)
        assert a_client.put(ns, list(pages), keys=keys).stored == 8
    with MessengerClient(b["messenger"], token=admin, tls_ca_file=ca) as mc:
        reply = mc.submit(ns, [(k, a["messenger"]) for k in keys])
        status = mc.status(reply.batch_id, wait=True, timeout_s=60)
        assert [e.state for e in status.entries] == [mpb.ENTRY_DONE] * 8, status
    with KVStoreClient(b["address"], token=admin, tls_ca_file=ca, use_shm=False) as b_client:
        np.testing.assert_array_equal(np.stack(b_client.get(ns, keys=keys)), pages)


# ---- connection slots before HELLO ----------------------------------------------------------


def test_connections_before_hello_are_capped_per_address(start_node, start_kvcache, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("admin-token\n")
    node = start_node("--token-file", str(token_file))
    messenger = start_kvcache(
        "messenger", "--node", node.address, "--token-file", str(token_file),
        "--max-connections", "32", "--max-unauthenticated-per-peer", "8",
        "--frame-timeout", "30",
    )  # fmt: skip
    client = KVStoreClient(node.address, token="admin-token")
    keys = keys_from_block_ids(list(range(4)), root_key(NS, b"pre-hello"))
    pages = np.random.default_rng(1).integers(0, 256, (4, PB), dtype=np.uint8)
    assert client.put(NS, list(pages), keys=keys).stored == 4
    host, port = messenger.info["data_address"].rsplit(":", 1)
    stats = MessengerClient(messenger.address, token="admin-token")

    # A stranger on another address opens 40 connections and never says HELLO.
    held = []
    try:
        for _ in range(40):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.2", 0))
            s.connect((host, int(port)))
            held.append(s)
        # Each one was taken in or refused at once (refusals close the connection).
        wait_until(
            lambda: stats.stats().open_connections + sum(1 for s in held if _closed(s)) == 40,
            what="the stranger's connections to be accepted or refused",
        )
        assert stats.stats().open_connections == 8  # --max-unauthenticated-per-peer
        # A peer with the data token still gets a slot and its pages.
        dest = np.zeros((4, PB), dtype=np.uint8)
        t = TcpTransport(
            TcpConfig(lanes=1, connect_timeout_s=5, io_timeout_s=10,
                      token=derive_data_token("admin-token"))
        )  # fmt: skip
        try:
            admin = Identity("", b"admin-token")  # whom the pull is for, proven
            views = [memoryview(p) for p in dest]
            res = t.fetch(messenger.info["data_address"], NS, keys, views, admin)
        finally:
            t.close()
        assert all(r.ok for r in res), res
        np.testing.assert_array_equal(dest, pages)
    finally:
        for s in held:
            s.close()
        client.close()
        stats.close()
    wait_until(lambda: "have not said HELLO yet" in messenger.log(), 10, "the refusals logged")


def _closed(s: socket.socket) -> bool:
    """Whether the server closed this connection (EOF or reset; what it said before is read and
    dropped), without blocking."""
    try:
        while s.recv(65536, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True
