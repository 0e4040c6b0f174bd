"""clients.conductor_aio.AsyncScheduleStream (the router's Schedule path) against a real
conductor process: the thread-based ScheduleStream's behaviour, on an event loop."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import numpy as np
import pytest

from clients.conductor_aio import AsyncScheduleStream
from clients.conductor_client import ConductorClient, selector
from proto import conductor_pb2 as pb
from rpc.status import KVCacheRpcError

from conftest import TEST_BLOCK_TOKENS, TEST_NAMESPACE
from helpers import sigstop, wait_until

NS = TEST_NAMESPACE
OK = grpc.StatusCode.OK.value[0]
BAD = grpc.StatusCode.INVALID_ARGUMENT.value[0]


def tokens(n_blocks: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n_blocks * TEST_BLOCK_TOKENS, dtype=np.int64)


def one(request_id: str = "") -> list[pb.ScheduleRequest]:
    return [pb.ScheduleRequest(request_id=request_id, blocks=selector(NS, tokens=tokens(1)))]


async def failure(stream: AsyncScheduleStream, requests) -> tuple[grpc.StatusCode, str]:
    try:
        await stream.schedule_batch(requests)
    except KVCacheRpcError as e:
        return e.code, e.details
    raise AssertionError("the batch did not fail")


async def first_batch_failure(
    address: str, token: str | None = None
) -> tuple[grpc.StatusCode, str]:
    """How a new client's first batch on a stream to ``address`` fails."""
    with ConductorClient(address, token=token, timeout_s=3) as cc:
        stream = AsyncScheduleStream(cc)
        try:
            return await failure(stream, one())
        finally:
            await stream.aclose()


@pytest.fixture
def cluster(start_kvcache, start_node):
    """A conductor with a prefill and a decode node registered; its start_kvcache starter for
    another conductor."""

    def start(*extra: str):
        c = start_kvcache("conductor", "--listen", "127.0.0.1:0", *extra)
        for node_id, role in (("p0", "prefill"), ("d0", "decode")):
            start_node("--conductor", c.address, "--node-id", node_id, "--role", role)
        with ConductorClient(c.address) as cc:
            wait_until(lambda: len(cc.list_nodes().nodes) == 2, what="two registrations")
        return c

    return start


def test_a_stream_answers_each_batch_in_order_and_never_hangs(cluster, start_kvcache):
    """Every batch on one call, answered in order (one bad item fails only itself); a batch
    over the limit ends the stream with its status and the next opens another; a conductor
    that stops answering costs the client's timeout, then DEADLINE_EXCEEDED, and the next
    batch opens a new stream; a token the conductor does not know is refused."""
    c = cluster()

    async def run() -> None:
        with ConductorClient(c.address, timeout_s=3) as cc:
            stream = AsyncScheduleStream(cc)
            try:
                for i in range(3):
                    outcomes = await stream.schedule_batch(
                        [
                            pb.ScheduleRequest(
                                request_id=f"s{i}a", blocks=selector(NS, tokens=tokens(2))
                            ),
                            pb.ScheduleRequest(
                                request_id=f"s{i}b", blocks=selector(NS, keys=[b"short"])
                            ),
                        ]
                    )
                    assert [o.code for o in outcomes] == [OK, BAD]
                    assert outcomes[0].reply.request_id == f"s{i}a"
                    assert (outcomes[0].reply.prefill_node, outcomes[0].reply.decode_node) == (
                        "p0",
                        "d0",
                    )
                assert stream.opened == 1 and stream.streaming
                # concurrent batches take turns on the one stream, each answered its own
                replies = await asyncio.gather(
                    *(stream.schedule_batch(one(f"c{i}")) for i in range(8))
                )
                assert [r[0].reply.request_id for r in replies] == [f"c{i}" for i in range(8)]
                assert stream.opened == 1
                code, msg = await failure(stream, one() * 1025)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 1024" in msg
                assert (await stream.schedule_batch(one()))[0].code == OK
                assert stream.opened == 2
                sigstop(c.pid)
                try:
                    code, msg = await failure(stream, one())
                finally:
                    os.kill(c.pid, signal.SIGCONT)
                assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "within 3 s" in msg
                assert not stream.streaming
                assert (await stream.schedule_batch(one()))[0].code == OK
                assert stream.opened == 3
            finally:
                await stream.aclose()

    asyncio.run(run())
    guarded = start_kvcache(
        "conductor", "--listen", "127.0.0.1:0", "--token", "admin-secret", "--tenant-token",
        "t1=alice",
    )  # fmt: skip

    code, _ = asyncio.run(first_batch_failure(guarded.address, token="nobody"))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_a_refused_stream_goes_unary_and_a_stopped_conductor_is_unavailable(cluster):
    """Past the conductor's ``--max-streams`` a stream is refused and its batches go unary,
    answered all the same, for ``REFUSED_S``; a conductor that is gone is UNAVAILABLE (the
    unary call's own verdict), never a hang."""
    c = cluster("--workers", "3", "--max-streams", "1")

    async def run() -> None:
        with ConductorClient(c.address, timeout_s=5) as a, ConductorClient(c.address) as b:
            first, second = AsyncScheduleStream(a), AsyncScheduleStream(b)
            try:
                assert (await first.schedule_batch(one()))[0].code == OK and first.streaming
                assert (await second.schedule_batch(one()))[0].code == OK
                assert not second.streaming and second.opened == 1
                assert (await second.schedule_batch(one()))[0].code == OK
                assert second.opened == 1  # unary for a while: no new stream asked for
            finally:
                await first.aclose()
                await second.aclose()

    asyncio.run(run())
    c.stop()

    code, _ = asyncio.run(first_batch_failure(c.address))
    assert code == grpc.StatusCode.UNAVAILABLE
