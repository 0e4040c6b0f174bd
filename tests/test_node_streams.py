"""Idle streams against a real node process: clients that open Get, Put or Events streams and
then never read or send must not take the gRPC workers unary calls need, and are cut in time."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import pytest

from clients import KVStoreClient
from proto import common_pb2 as cpb
from proto import node_pb2 as pb
from proto import node_pb2_grpc as pbg

from conftest import TEST_BLOCK_TOKENS, TEST_NAMESPACE, TEST_PAGE_BYTES
from helpers import wait_until

NS = TEST_NAMESPACE
BLOCKS = 1024  # 8 MiB per Get: far more than a client buffers without reading


def tokens(n_blocks: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n_blocks * TEST_BLOCK_TOKENS, dtype=np.int64)


def raw_stub(address: str) -> tuple[grpc.Channel, pbg.NodeServiceStub]:
    # NOTE: a connection of its own: streams on one HTTP/2 connection share its flow-control
    # window, and an unread Get must not stall the test's own calls on the client side.
    channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
    return channel, pbg.NodeServiceStub(channel)


def metric_sum(node, name: str) -> float:
    """A counter of the node's Prometheus metrics, summed over its labels."""
    port = node.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def code_of(call, stream: bool) -> grpc.StatusCode:
    """How a call ended: drain a response stream (its buffered chunks first), or wait for a
    Put's reply."""
    try:
        if stream:
            for _ in call:
                pass
        else:
            call.result(timeout=30)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_idle_streams_leave_workers_for_unary_calls_and_are_cut(start_node):
    # 16 Get/Put, 4 Events
    node = start_node("--stream-idle-timeout", "2", "--metrics-port", "0", dram="16MiB")
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, TEST_PAGE_BYTES, dtype=np.uint8) for _ in range(BLOCKS)]
    never = threading.Event()
    channels: list[grpc.Channel] = []
    with KVStoreClient(node.address) as c:
        c.put(NS, pages, tokens=tokens(BLOCKS))
        # A conductor's feed, read all along: it must outlive the idle deadline.
        feed = c.events(resync=True)
        assert next(feed).snapshot

        def silent_put():
            yield pb.PutChunk(header=pb.PutHeader(blocks=cpb.BlockSelector(namespace=NS)))
            never.wait(60)

        def silent_put_no_header():
            never.wait(60)
            yield pb.PutChunk()

        gets, puts, events = [], [], []
        sel = cpb.BlockSelector(namespace=NS, token_ids=tokens(BLOCKS).tolist())
        try:
            for i in range(40):
                channel, stub = raw_stub(node.address)
                channels.append(channel)
                if i % 3 == 0:
                    gets.append(stub.Get(pb.GetRequest(blocks=sel)))  # never read
                elif i % 3 == 1:
                    put = silent_put() if i % 2 else silent_put_no_header()
                    puts.append(stub.Put.future(put))  # never sends (more)
                else:
                    events.append(stub.Events(pb.EventsRequest(after_seq=0)))  # never read
            # Every stream reached the node: those over the caps were refused.
            over_caps = (27 - 16) + (13 - 3)  # Get/Put over 16, Events over 4 (the feed holds one)
            wait_until(
                lambda: metric_sum(node, "kvcache_node_streams_refused_total") == over_caps,
                30,
                "the streams over the caps to be refused",
            )

            # Unary calls are still served, at once (they timed out: every worker was taken).
            channel, stub = raw_stub(node.address)
            channels.append(channel)
            for _ in range(5):
                t0 = time.monotonic()
                assert stub.Lookup(sel, timeout=1.0).hit_blocks == BLOCKS
                assert time.monotonic() - t0 < 1.0

            # The streams over the caps were refused at once; the rest are cut when idle (a Get
            # whose client stopped reading: its chunks buffered so far, then the status).
            wait_until(
                lambda: metric_sum(node, "kvcache_node_streams_cut_total") >= 16,
                30,
                "the idle Get and Put streams to be cut",
            )
            codes = [code_of(g, True) for g in gets] + [code_of(p, False) for p in puts]
            counts = {code: codes.count(code) for code in set(codes)}
            assert counts == {
                grpc.StatusCode.RESOURCE_EXHAUSTED: 27 - 16,
                grpc.StatusCode.DEADLINE_EXCEEDED: 16,
            }, counts
            # Events streams: 4 at most; the reader above holds one.
            for s in events:
                s.cancel()
            refused = [code_of(s, True) for s in events].count(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert refused == len(events) - 3
        finally:
            never.set()
            for channel in channels:
                channel.close()

        # The feed read all along is still open and live.
        c.put(NS, pages[:1], tokens=tokens(1, start=10**6))
        batch = next(feed)
        assert [e.kind for e in batch.events] == [cpb.EVENT_STORED]
    # The cut streams gave their slots back: 16 streamed Gets that read all work at once.
    with KVStoreClient(node.address, use_shm=False) as s:
        with futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(lambda n: s.get(NS, tokens=tokens(n))[-1], range(1, 17)))
        for n, have in enumerate(got, 1):
            np.testing.assert_array_equal(have, pages[n - 1])
        assert s.stats().namespaces[0].blocks == BLOCKS + 1


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--max-streams", "0"), "--max-streams and --max-event-streams must be >= 1"),
        (("--max-streams", "30"), "must leave 8 of the 32 gRPC workers"),
        (("--stream-idle-timeout", "nan"), "--stream-idle-timeout must be finite"),
        (("--write-quarantine", "-1"), "--write-quarantine must be finite seconds >= 0"),
    ],
)
def test_bad_stream_and_quarantine_flags_fail_at_start(start_node, flags, message):
    with pytest.raises(RuntimeError, match=message):
        start_node(*flags)
