"""Hostile or broken peers on a messenger's data port, against real node + messenger processes.

Each test starts one node and its messenger (test-only fault flags where needed) and plays the
bad peer over raw sockets. The messenger must say why once, not spin, and keep serving others.
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.request

import numpy as np
import pytest

from clients.node_client import KVStoreClient
from kvstore.keys import keys_from_block_ids, root_key
from messenger.tcp import TcpConfig, TcpTransport
from messenger.transport import Outcome

from conftest import TEST_NAMESPACE as NS
from conftest import TEST_PAGE_BYTES as PB
from helpers import wait_until


def make_keys(n: int, start: int = 0) -> list[bytes]:
    return keys_from_block_ids(list(range(start, start + n)), root_key(NS, b"limits-test"))


class Source:
    """A node and its messenger; the test is the (bad) peer on the messenger's data port."""

    def __init__(self, start_node, start_kvcache, messenger_args, dram: str) -> None:
        self.node = start_node(dram=dram)
        self.messenger = start_kvcache(
            "messenger", "--node", self.node.address, "--metrics-port", "0", *messenger_args
        )
        self.client = KVStoreClient(self.node.address)
        host, port = self.messenger.info["data_address"].rsplit(":", 1)
        self.data = (host, int(port))
        self.data_address = self.messenger.info["data_address"]

    def put(self, n: int, start: int = 0, keys: list[bytes] | None = None) -> list[bytes]:
        keys = keys or make_keys(n, start)
        pages = np.random.default_rng(start).integers(0, 256, (len(keys), PB), dtype=np.uint8)
        assert self.client.put(NS, list(pages), keys=keys).stored == len(keys)
        return keys

    def connect(self, timeout_s: float = 5.0, **opts: int) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for opt, value in opts.items():
            s.setsockopt(socket.SOL_SOCKET, getattr(socket, opt), value)
        s.settimeout(timeout_s)
        s.connect(self.data)
        return s

    def fetch_ok(self, keys: list[bytes]) -> bool:
        """A well-behaved peer's fetch: True when every page arrived."""
        dest = np.zeros((len(keys), PB), dtype=np.uint8)
        t = TcpTransport(TcpConfig(lanes=1, connect_timeout_s=2, io_timeout_s=5))
        try:
            res = t.fetch(self.data_address, NS, keys, [memoryview(p) for p in dest])
        finally:
            t.close()
        return all(r.ok for r in res)

    def metric(self, name: str) -> float:
        port = self.messenger.info["metrics_port"]
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text.decode(), re.M)
        return float(m.group(1)) if m else 0.0

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.messenger.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_size(self) -> int:
        return os.path.getsize(self.messenger.log_path)


@pytest.fixture
def source(start_node, start_kvcache):
    made: list[Source] = []

    def start(*messenger_args: str, dram: str = "16MiB") -> Source:
        s = Source(start_node, start_kvcache, messenger_args, dram)
        made.append(s)
        return s

    yield start
    for s in made:
        s.client.close()


# ---- accept: out of file descriptors ------------------------------------------------------------


def test_out_of_file_descriptors_backs_off_quietly_and_recovers(source):
    src = source("--fault-open-files", "8")
    keys = src.put(4)
    wait_until(lambda: "open files limited" in src.messenger.log(), 10, "the fd limit")
    # More connections than the messenger has descriptors: the rest wait in its backlog, and
    # every accept fails at once with EMFILE for as long as they wait.
    socks = [src.connect() for _ in range(24)]
    try:
        wait_until(lambda: "out of file descriptors" in src.messenger.log(), 10, "EMFILE")
        cpu0, log0 = src.cpu_seconds(), src.log_size()
        time.sleep(2.0)
        cpu, grown = src.cpu_seconds() - cpu0, src.log_size() - log0
        # Backing off: no spinning (it used ~2 s of CPU here), no log flood (~7 MB in 2 s).
        assert cpu < 0.5, f"accept loop spent {cpu:.2f} s of CPU in 2 s"
        assert grown < 2000, f"log grew {grown} bytes in 2 s"
        assert src.messenger.log().count("out of file descriptors") == 1  # once per episode
    finally:
        for s in socks:
            s.close()
    # Descriptors free again: the messenger serves peers once more.
    wait_until(lambda: src.fetch_ok(keys), 15, "a fetch after the descriptors came back")
    assert "accepting again" in src.messenger.log()
    assert src.metric("kvcache_messenger_accept_errors_total") >= 1


# ---- many missing keys --------------------------------------------------------------------------


def test_a_fetch_of_1500_keys_mostly_missing_answers_not_found_per_key(source):
    src = source()
    keys = make_keys(1500, start=100_000)
    present = set(range(1480, 1500))
    src.put(0, keys=keys[1480:])
    dest = np.zeros((1500, PB), dtype=np.uint8)
    t = TcpTransport(TcpConfig(lanes=1))  # one request of 1500 keys
    try:
        res = t.fetch(src.data_address, NS, keys, [memoryview(p) for p in dest])
    finally:
        t.close()
    assert [i for i, r in enumerate(res) if r.ok] == sorted(present)
    missing = [r for i, r in enumerate(res) if i not in present]
    assert {r.outcome for r in missing} == {Outcome.NOT_FOUND}
    assert missing[0].reason == "source does not hold the key"
    got = src.client.get(NS, keys=keys[1480:])
    assert all(np.array_equal(g, dest[1480 + i]) for i, g in enumerate(got))
