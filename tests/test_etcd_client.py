"""plumbing/etcd.py and plumbing/registration.py against a real etcd server: keys, leases, watches
that report a broken stream, endpoint failover, etcd's election, and Registration's lease upkeep."""

from __future__ import annotations

import queue
import threading

import pytest

from plumbing.etcd import (
    EtcdClient,
    EtcdUnavailable,
    check_prefix,
    parse_endpoints,
)
from plumbing.launch import free_port
from plumbing.registration import Registration

from helpers import wait_until


def test_endpoints_and_prefix_are_checked():
    assert parse_endpoints("http://10.0.0.1:2379, https://h:2380") == [
        "http://10.0.0.1:2379",
        "https://h:2380",
    ]
    assert parse_endpoints("127.0.0.1:2379") == ["http://127.0.0.1:2379"]
    for bad in ("", ",", "ftp://h:1", "http://h", "http://h:2379/v3", "http://:2379"):
        with pytest.raises(ValueError):
            parse_endpoints(bad)
    assert check_prefix("/kvcache/") == "/kvcache"
    for bad in ("kvcache", "/", ""):
        with pytest.raises(ValueError):
            check_prefix(bad)


def _read(watch, out: queue.Queue) -> threading.Thread:
    def run():
        try:
            for batch in watch:
                for e in batch.events:
                    out.put(("del" if e.deleted else "put", e.kv.key, e.kv.value))
        except EtcdUnavailable as e:
            out.put(("broken", str(e), b""))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_keys_leases_and_a_watch_that_reports_its_end(etcd_server):
    with EtcdClient(etcd_server.endpoint) as etcd:
        lease = etcd.grant(1)
        rev = etcd.put("/t/nodes/a", b"A", lease)
        assert etcd.get("/t/nodes/a").value == b"A"
        assert etcd.get("/t/nodes/a").lease == lease
        listed_at, kvs = etcd.get_prefix("/t/")
        assert listed_at >= rev and [kv.key for kv in kvs] == ["/t/nodes/a"]

        events: queue.Queue = queue.Queue()
        watch = etcd.watch_prefix("/t/", listed_at + 1)
        _read(watch, events)
        etcd.put("/t/nodes/b", b"B")
        assert events.get(timeout=5) == ("put", "/t/nodes/b", b"B")
        # not renewed: etcd deletes the key when the lease lapses
        assert events.get(timeout=5)[:2] == ("del", "/t/nodes/a")
        assert etcd.keepalive(lease) == 0
        assert etcd.delete("/t/nodes/b") and not etcd.delete("/t/nodes/b")
        assert events.get(timeout=5)[:2] == ("del", "/t/nodes/b")

        etcd_server.kill()  # the stream breaks: the reader hears of it, it does not hang
        kind, message, _ = events.get(timeout=10)
        assert kind == "broken", message
        with pytest.raises(EtcdUnavailable, match="no etcd endpoint answered"):
            etcd.get("/t/nodes/a")


def test_a_dead_endpoint_is_skipped(etcd_server):
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with EtcdClient(f"{dead},{etcd_server.endpoint}") as etcd:
        etcd.put("/t/x", b"1")
        assert etcd.get("/t/x").value == b"1"
        watch = etcd.watch_prefix("/t/", 1)
        watch.close()


def test_election_leader_and_handover(etcd_server):
    with EtcdClient(etcd_server.endpoint) as etcd:
        assert etcd.leader("/t/conductor/leader") is None
        first = etcd.grant(30)
        key = etcd.campaign("/t/conductor/leader", first, b"one")
        assert etcd.leader("/t/conductor/leader").value == b"one"
        second = etcd.grant(30)
        won: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: won.put(etcd.campaign("/t/conductor/leader", second, b"two")),
            daemon=True,
        ).start()
        with pytest.raises(queue.Empty):
            won.get(timeout=0.5)  # the second candidate waits behind the leader
        etcd.resign(key)
        assert won.get(timeout=5)["lease"] == str(second)
        assert etcd.leader("/t/conductor/leader").value == b"two"


def test_registration_renews_rewrites_and_revokes(etcd_server):
    value = [b"v1"]
    with EtcdClient(etcd_server.endpoint) as etcd:
        reg = Registration(etcd, "/t/nodes/n0", lambda: value[0], ttl_s=1, refresh_s=0).start()
        try:
            assert reg.registered.wait(5)
            # renewed every ttl/3: alive well past its TTL
            threading.Event().wait(2.5)
            assert etcd.get("/t/nodes/n0").value == b"v1"
            value[0] = b"v2"
            wait_until(lambda: etcd.get("/t/nodes/n0").value == b"v2", 5, "the new value")
            etcd.revoke(reg.lease)  # etcd lost the lease: the next renewal registers again
            wait_until(lambda: reg.registrations == 2, 5, "a new lease")
            assert etcd.get("/t/nodes/n0").value == b"v2"
        finally:
            reg.stop()
        assert etcd.get("/t/nodes/n0") is None  # revoked at stop: gone at once
