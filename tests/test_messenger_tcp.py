"""TCP transport between two real processes: a slab peer (source) and this process (destination).

The source is ``python -m messenger.slab_peer``: a DataServer over a shared-memory slab filled
with a deterministic pattern; the destination receives into shared-memory page views.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvstore.shm import SharedSlab, unique_shm_name
from messenger.frames import (
    HEADER_BYTES,
    Kind,
    Status,
    checksum,
    pack_header,
    recv_exact,
    unpack_header,
    unpack_keys_body,
)
from messenger.slab_peer import NAMESPACE, expected_page, fill_pattern, pattern_keys
from messenger.tcp import TcpConfig, TcpTransport
from messenger.transport import FetchGroup, Outcome

PAGES = 48
PAGE_BYTES = 64 << 10


class SlabPeer:
    def __init__(self, *extra: str, pages: int = PAGES, page_bytes: int = PAGE_BYTES) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "messenger.slab_peer",
                "--pages",
                str(pages),
                "--page-bytes",
                str(page_bytes),
                *extra,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()  # READY is the real readiness signal
        assert line.startswith("READY "), f"slab peer did not start: {line!r}"
        self.address = json.loads(line[6:])["address"]
        self.stats: dict | None = None

    def stop(self) -> dict:
        """Close its stdin (its signal to exit) and return its server stats; idempotent."""
        if self.stats is None:
            self.proc.stdin.close()
            out = self.proc.stdout.read()
            assert self.proc.wait(timeout=30) == 0
            line = [ln for ln in out.splitlines() if ln.startswith("STATS ")][0]
            self.stats = json.loads(line[6:])
        return self.stats


@pytest.fixture
def peer():
    p = SlabPeer()
    yield p
    p.stop()


@pytest.fixture
def dest():
    slab = SharedSlab.create(unique_shm_name("test-dst"), PAGES * PAGE_BYTES)
    pages = slab.array.reshape(PAGES, PAGE_BYTES)
    pages[:] = 0
    yield pages
    del pages
    slab.close()
    slab.unlink()


def expected(n: int = PAGES) -> np.ndarray:
    out = np.empty((n, PAGE_BYTES), dtype=np.uint8)
    fill_pattern(out)
    return out


def views(pages: np.ndarray) -> list[memoryview]:
    return [memoryview(pages[i]) for i in range(len(pages))]


@pytest.mark.parametrize("lanes,request_bytes", [(1, 32 << 20), (3, 4 * PAGE_BYTES)])
def test_fetch_moves_exact_bytes(peer, dest, lanes, request_bytes):
    t = TcpTransport(TcpConfig(lanes=lanes, request_bytes=request_bytes))
    try:
        results = t.fetch(peer.address, NAMESPACE, pattern_keys(PAGES), views(dest))
        assert [r.outcome for r in results] == [Outcome.OK] * PAGES
        np.testing.assert_array_equal(dest, expected())
        # Pooled connections are reused: never more open than lanes held at once (a lane that
        # starts late may even reuse one a finished lane gave back).
        dest[:] = 0
        results = t.fetch(peer.address, NAMESPACE, pattern_keys(PAGES)[5:9], views(dest[:4]))
        assert all(r.ok for r in results)
        np.testing.assert_array_equal(dest[:4], expected()[5:9])
        assert 1 <= t.stats.connections_opened <= lanes
    finally:
        t.close()
    stats = peer.stop()
    assert stats["pages_sent"] == PAGES + 4


def test_groups_are_taken_as_the_lane_has_room_and_reported_one_by_one(peer, dest):
    """fetch_groups asks for a group only when a lane can request it (window 2 here), so the
    caller allocates late, and reports each group as soon as it landed, in order on one lane."""
    t = TcpTransport(TcpConfig(lanes=1, request_bytes=4 * PAGE_BYTES))
    keys, vs = pattern_keys(PAGES), views(dest)
    events: list[tuple[str, int]] = []

    def groups():
        for s in range(0, PAGES, 4):
            events.append(("take", s))
            yield FetchGroup(keys[s : s + 4], vs[s : s + 4], s)

    def done(group, results):
        events.append(("done", group.tag))
        assert [r.outcome for r in results] == [Outcome.OK] * 4

    try:
        t.fetch_groups(peer.address, NAMESPACE, PAGE_BYTES, PAGES, groups(), done)
    finally:
        t.close()
    assert [s for kind, s in events if kind == "done"] == list(range(0, PAGES, 4))
    outstanding = [0]
    for kind, _ in events:
        outstanding.append(outstanding[-1] + (1 if kind == "take" else -1))
    assert max(outstanding) == 2  # never more groups taken than requests in flight
    np.testing.assert_array_equal(dest, expected())


def test_missing_keys_fail_not_found_rest_complete(dest):
    p = SlabPeer("--missing", "3,17")
    t = TcpTransport(TcpConfig(lanes=2, request_bytes=8 * PAGE_BYTES))
    try:
        results = t.fetch(p.address, NAMESPACE, pattern_keys(PAGES), views(dest))
    finally:
        t.close()
        p.stop()
    assert {i for i, r in enumerate(results) if not r.ok} == {3, 17}
    assert results[3].outcome is Outcome.NOT_FOUND
    exp = expected()
    for i in set(range(PAGES)) - {3, 17}:
        np.testing.assert_array_equal(dest[i], exp[i])


def test_corrupted_bytes_are_caught_by_the_checksum(dest):
    p = SlabPeer("--corrupt-every", "5")
    t = TcpTransport(TcpConfig(lanes=1))
    try:
        results = t.fetch(p.address, NAMESPACE, pattern_keys(PAGES), views(dest))
    finally:
        t.close()
        p.stop()
    bad = [i for i, r in enumerate(results) if not r.ok]
    assert bad == list(range(4, PAGES, 5))
    assert all(results[i].outcome is Outcome.DATA_LOSS for i in bad)
    assert "checksum" in results[4].reason
    exp = expected()
    for i in set(range(PAGES)) - set(bad):
        np.testing.assert_array_equal(dest[i], exp[i])


def test_unknown_namespace_and_page_size_mismatch_fail_every_entry(peer, dest):
    t = TcpTransport(TcpConfig(lanes=2))
    try:
        keys = pattern_keys(4)
        res = t.fetch(peer.address, "other|ns", keys, views(dest[:4]))
        assert {r.outcome for r in res} == {Outcome.INVALID}
        assert "unknown namespace" in res[0].reason
        half = [memoryview(dest[i])[: PAGE_BYTES // 2] for i in range(4)]
        res = t.fetch(peer.address, NAMESPACE, keys, half)
        assert {r.outcome for r in res} == {Outcome.INVALID}
        assert "page size mismatch" in res[0].reason
        # The connection stays usable after error replies.
        res = t.fetch(peer.address, NAMESPACE, keys, views(dest[:4]))
        assert all(r.ok for r in res)
    finally:
        t.close()


def test_unreachable_peer_fails_every_entry_unavailable(dest):
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    t = TcpTransport(TcpConfig(lanes=2, connect_timeout_s=2))
    try:
        res = t.fetch(f"127.0.0.1:{port}", NAMESPACE, pattern_keys(3), views(dest[:3]))
    finally:
        t.close()
    assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
    assert "cannot connect" in res[0].reason


def test_a_lane_to_a_peer_that_is_gone_takes_no_more_groups(dest):
    """Each group a transport takes is a group the caller leased pages for (an Allocate that may
    evict): a lane whose peer is gone stops taking them (before, it took and failed every group
    of the job), and the groups no lane took get the lane's failure."""
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    taken: list[int] = []

    def groups():
        for i in range(10):
            taken.append(i)
            yield FetchGroup(pattern_keys(10)[i : i + 1], views(dest[i : i + 1]), i)

    reported: list[FetchGroup] = []
    t = TcpTransport(TcpConfig(lanes=2, connect_timeout_s=2))
    try:
        stopped = t.fetch_groups(
            f"127.0.0.1:{port}",
            NAMESPACE,
            PAGE_BYTES,
            10,
            groups(),
            lambda g, r: reported.append(g),
        )
    finally:
        t.close()
    assert len(taken) <= 2 and len(reported) == len(taken)  # one per lane, each failed
    assert stopped is not None and stopped.outcome is Outcome.UNAVAILABLE
    assert "cannot connect" in stopped.reason


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 64,  # wrong magic
        pack_header(Kind.PAGE),  # a frame clients never send
        pack_header(Kind.FETCH, count=1 << 20, length=16),  # too many keys
        pack_header(Kind.FETCH, count=1, length=1 << 30),  # oversized body
        pack_header(Kind.FETCH, count=2, length=4, checksum_=1) + b"abcd",  # bad body checksum
    ],
)
def test_garbage_on_the_data_port_drops_the_connection_and_server_survives(peer, dest, garbage):
    host, port = peer.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(garbage)
        # The server hangs up on us: EOF (or a reset) instead of a reply.
        try:
            assert s.recv(1024) == b""
        except ConnectionResetError:
            pass
    t = TcpTransport()
    try:
        res = t.fetch(peer.address, NAMESPACE, pattern_keys(4), views(dest[:4]))
        assert all(r.ok for r in res)
    finally:
        t.close()
    assert peer.stop()["dropped_connections"] == 1


class CuttingPeer:
    """A source that answers one FETCH with ``full`` good pages and then half a page, then hangs
    up: a connection cut mid-transfer, from the destination's point of view."""

    def __init__(self, full: int, bad_reply: bytes | None = None) -> None:
        self.full, self.bad_reply = full, bad_reply
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            hbuf = bytearray(HEADER_BYTES)
            recv_exact(conn, memoryview(hbuf))
            h = unpack_header(hbuf)
            body = bytearray(h.length)
            recv_exact(conn, memoryview(body))
            _, page_bytes, keys = unpack_keys_body(bytes(body), h.count)
            if self.bad_reply is not None:
                conn.sendall(self.bad_reply)
                return
            for i in range(self.full):
                page = expected_page(i, page_bytes).tobytes()
                conn.sendall(
                    pack_header(
                        Kind.PAGE,
                        Status.OK,
                        key=keys[i],
                        length=page_bytes,
                        checksum_=checksum(page),
                    )
                    + page
                )
            page = expected_page(self.full, page_bytes).tobytes()
            conn.sendall(
                pack_header(
                    Kind.PAGE,
                    Status.OK,
                    key=keys[self.full],
                    length=page_bytes,
                    checksum_=checksum(page),
                )
                + page[: page_bytes // 2]
            )

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.server.close()


def test_connection_cut_mid_transfer_fails_the_rest(dest):
    p = CuttingPeer(full=3)
    t = TcpTransport(TcpConfig(lanes=1))
    try:
        res = t.fetch(p.address, NAMESPACE, pattern_keys(8), views(dest[:8]))
    finally:
        t.close()
        p.close()
    assert [r.ok for r in res] == [True] * 3 + [False] * 5
    assert all(r.outcome is Outcome.UNAVAILABLE for r in res[3:])
    assert "lost" in res[3].reason
    exp = expected(3)
    np.testing.assert_array_equal(dest[:3], exp)


def test_protocol_violation_by_the_source_fails_entries(dest):
    p = CuttingPeer(full=0, bad_reply=b"\x00" * 200)
    t = TcpTransport(TcpConfig(lanes=1))
    try:
        res = t.fetch(p.address, NAMESPACE, pattern_keys(4), views(dest[:4]))
    finally:
        t.close()
        p.close()
    assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
    assert "protocol error" in res[0].reason


def test_bad_views_are_rejected(peer, dest):
    t = TcpTransport()
    try:
        with pytest.raises(ValueError, match="writable"):
            t.fetch(peer.address, NAMESPACE, pattern_keys(1), [memoryview(bytes(PAGE_BYTES))])
        with pytest.raises(ValueError, match="keys but"):
            t.fetch(peer.address, NAMESPACE, pattern_keys(2), views(dest[:1]))
    finally:
        t.close()


def test_token_protected_data_port(dest):
    region = np.empty(4 * PAGE_BYTES, dtype=np.uint8)
    fill_pattern(region.reshape(4, PAGE_BYTES))
    keys = pattern_keys(4)
    from messenger.data_server import DataServer
    from messenger.transport import SlabPageSource

    server = DataServer(
        SlabPageSource(NAMESPACE, region, PAGE_BYTES, {k: i for i, k in enumerate(keys)}),
        token="s3cret",
    ).start()
    try:
        for token, ok in ((None, False), ("wrong", False), ("s3cret", True)):
            t = TcpTransport(TcpConfig(lanes=1, token=token))
            try:
                res = t.fetch(server.address, NAMESPACE, keys, views(dest[:4]))
            finally:
                t.close()
            if ok:
                assert all(r.ok for r in res)
                np.testing.assert_array_equal(dest[:4], region.reshape(4, PAGE_BYTES))
            else:
                assert {r.outcome for r in res} == {Outcome.UNAVAILABLE}
                assert "token" in res[0].reason
        assert server.stats.pages_sent == 4
    finally:
        server.stop()


def test_a_malformed_peer_address_fails_every_entry_invalid(dest):
    # A bad data address (a broken source's GetInfo, a bad source_data) is a per-entry result,
    # not an exception out of fetch: the mover must still abort its write lease.
    t = TcpTransport(TcpConfig(lanes=2))
    try:
        for bad in ("no-port", "127.0.0.1:99999", "127.0.0.1:http"):
            res = t.fetch(bad, NAMESPACE, pattern_keys(2), views(dest[:2]))
            assert {r.outcome for r in res} == {Outcome.INVALID}
            assert "host:port" in res[0].reason
    finally:
        t.close()
