"""etcd as an attacker uses it: whoever writes under the cluster's prefix names the addresses the
conductor opens event feeds to and clients call, each with its token. A real etcd; a forged
record points at a listener of the test's, which must never be sent a token in clear; and
``kvcache up --etcd --tls`` serves etcd to the cluster's own processes only."""

from __future__ import annotations

import json
import os
import socket
import threading

import grpc
import pytest
import requests

from clients.conductor_client import ConductorClient
from plumbing.etcd import EtcdClient
from plumbing.registration import ConductorRecord, NodeRecord, election_name, nodes_prefix
from rpc.cluster import NodeDescriptor, NodeLoad, Role

from conftest import TEST_NAMESPACE
from helpers import kvcache_cli, wait_until

TOKEN = "etcd-test-token"


class Listener:
    """The attacker's port: it counts the connections made to it and keeps what they sent."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = b""
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.settimeout(0.5)
            try:
                while chunk := conn.recv(65536):
                    self.received += chunk
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.close()


def test_a_forged_leader_record_gets_no_token_in_clear(etcd_server, listener):
    with EtcdClient(etcd_server.endpoint) as etcd:
        lease = etcd.grant(30)
        forged = ConductorRecord(address=listener.address, conductor_id="evil")
        etcd.campaign(election_name("/kvcache"), lease, forged.encode())
        with ConductorClient(etcd=etcd_server.endpoint, token=TOKEN, failover_timeout_s=3) as c:
            with pytest.raises(Exception) as e:
                c.schedule(TEST_NAMESPACE, tokens=list(range(16)))
        assert getattr(e.value, "code", None) is grpc.StatusCode.FAILED_PRECONDITION
        assert "only over TLS" in str(e.value)
        assert listener.connections == 0  # before: the client called it, token and all
        etcd.revoke(lease)


def test_a_conductor_fed_by_etcd_sends_its_token_only_over_tls(
    etcd_server, start_kvcache, tmp_path, listener
):
    (tmp_path / "token").write_text(TOKEN + "\n")
    args = ["conductor", "--listen", "127.0.0.1:0", "--etcd", etcd_server.endpoint]
    with pytest.raises(RuntimeError, match="--etcd with a token needs --node-tls-ca"):
        start_kvcache(*args, "--token-file", str(tmp_path / "token"))
    # With TLS it runs, and a forged node record gets a TLS handshake, never the token.
    from rpc.tls import make_local_ca

    files = make_local_ca(str(tmp_path / "tls"), [])
    start_kvcache(*args, "--token-file", str(tmp_path / "token"), "--node-tls-ca", files.ca_cert)
    record = NodeRecord(
        descriptor=NodeDescriptor(node_id="forged", address=listener.address, role=Role.BOTH),
        load=NodeLoad(),
        incarnation="x",
    )
    with EtcdClient(etcd_server.endpoint) as etcd:
        etcd.put(nodes_prefix("/kvcache") + "forged", record.encode())
        wait_until(lambda: listener.received, what="the conductor's feed to call the record")
    assert TOKEN.encode() not in listener.received
    assert listener.received[:1] == b"\x16"  # a TLS handshake record: nothing else was sent


@pytest.mark.slow
def test_up_with_etcd_and_tls_serves_etcd_to_its_own_processes_only(tmp_path):
    state_dir = tmp_path / "state"
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\nstate_dir = "{state_dir}"\n\n[defaults]\ndram = "16MiB"\n')
    refused = kvcache_cli(
        "up", "--config", str(config), "--detach", "--etcd", "--set", "cluster.token=t",
        "--no-tls",
    )  # fmt: skip
    if refused.returncode == 0:  # (before: it ran, its token in clear to etcd's addresses)
        kvcache_cli("down", "--state-dir", str(state_dir))
    assert refused.returncode == 2 and "needs --tls" in refused.stderr
    up = kvcache_cli("up", "--config", str(config), "--detach", "--etcd", "--tls")
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        with open(state_dir / "cluster.json") as f:
            state = json.load(f)
        endpoint = state["etcd"]["endpoints"][0]
        assert endpoint.startswith("https://")  # before: http, anyone on the network
        ca = state["tls_ca"]
        # Without the cluster's client certificate etcd answers nothing (no forged records).
        with pytest.raises(requests.RequestException):
            requests.post(f"{endpoint}/v3/kv/range", json={"key": "Lw=="}, verify=ca, timeout=5)
        with pytest.raises(requests.RequestException):
            requests.post(f"{endpoint.replace('https', 'http')}/v3/kv/range", json={}, timeout=5)
        # The cluster's own processes use it: the conductor leads and knows every node.
        tls = state["etcd"]["tls"]
        with ConductorClient(
            etcd=endpoint, token=state["token"], tls_ca_file=ca,
            etcd_ca=tls["ca"], etcd_cert=tls["cert"], etcd_key=tls["key"],
        ) as c:  # fmt: skip
            wait_until(lambda: len(c.list_nodes().nodes) == 3, 30, what="3 nodes in etcd")
        assert os.stat(tls["key"]).st_mode & 0o077 == 0
    finally:
        down = kvcache_cli("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stdout + down.stderr
