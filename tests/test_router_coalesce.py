"""clients.coalesce, as the router uses it: the router's conductor calls from requests in
flight go as batch RPCs; a request's end reaches the conductor before its client sees it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from clients.coalesce import AsyncCoalescer, Coalescer

from helpers import wait_until


class Wire:
    """A batch RPC that holds each call until the test lets it go."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.go = threading.Semaphore(0)
        self.fail: BaseException | None = None

    def send(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(list(items))
        self.go.acquire()
        if self.fail is not None:
            raise self.fail
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


def test_calls_that_arrive_while_a_batch_is_on_the_wire_go_together_in_order():
    wire = Wire()
    c = Coalescer(wire.send, "test-coalesce")
    try:
        first = c.submit(0)
        wait_until(lambda: wire.batches == [[0]], 10, "the first call to go at once, alone")
        rest = [c.submit(i) for i in range(1, 7)]
        wire.go.release()
        assert first.result(10) == 0
        wait_until(lambda: len(wire.batches) == 2, 10, "the next batch")
        assert wire.batches[1] == [1, 2, 3, 4, 5, 6]  # one RPC for the six, in order
        wire.go.release()
        for i, f in enumerate(rest, 1):
            if i % 2:
                with pytest.raises(ValueError, match=f"odd {i}"):  # its own outcome
                    f.result(10)
            else:
                assert f.result(10) == i * 10
        assert (c.batches, c.items) == (2, 7)
    finally:
        wire.go.release(10)
        c.close()


def test_a_failed_batch_fails_each_call_a_cancelled_call_is_not_sent_close_flushes():
    wire = Wire()
    c = Coalescer(wire.send, "test-coalesce", max_batch=2)
    holding = c.submit(0)
    wait_until(lambda: len(wire.batches) == 1, 10, "the first batch")
    dropped = c.submit(2)
    assert dropped.cancel()  # the caller left before it went
    kept = [c.submit(4), c.submit(6), c.submit(8)]
    wire.fail = ConnectionError("conductor gone")
    wire.go.release(10)
    with pytest.raises(ConnectionError):
        holding.result(10)
    for f in kept:
        with pytest.raises(ConnectionError):
            f.result(10)
    c.close()  # returns once what was pending went
    assert [b for b in wire.batches if 2 in b] == []  # the cancelled call never went
    assert sorted(i for b in wire.batches for i in b) == [0, 4, 6, 8]
    assert max(len(b) for b in wire.batches) == 2  # at most max_batch per RPC
    with pytest.raises(RuntimeError, match="stopping"):
        c.submit(10)


class AsyncWire:
    """The same batch RPC, awaited on an event loop."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.go = asyncio.Semaphore(0)
        self.fail: BaseException | None = None

    async def send(self, items: list[int]) -> list[int | BaseException]:
        self.batches.append(list(items))
        await self.go.acquire()
        if self.fail is not None:
            raise self.fail
        return [ValueError(f"odd {i}") if i % 2 else i * 10 for i in items]


async def settled() -> None:
    for _ in range(10):  # let the coalescer's task run up to its next wait
        await asyncio.sleep(0)


def test_on_an_event_loop_calls_wait_for_the_batch_on_the_wire_then_go_together():
    async def run() -> None:
        wire = AsyncWire()
        c = AsyncCoalescer(wire.send, max_batch=4)
        first = c.submit(0)
        await settled()
        assert wire.batches == [[0]]  # alone, at once
        rest = [c.submit(i) for i in range(1, 7)]
        dropped = c.submit(8)
        dropped.cancel()  # its caller left before the batch went: not sent
        wire.go.release()
        assert await first == 0
        await settled()
        assert wire.batches[1] == [1, 2, 3, 4]  # in order, at most max_batch per RPC
        wire.go.release()
        await settled()
        assert wire.batches[2] == [5, 6]
        wire.fail = ConnectionError("conductor gone")
        wire.go.release()
        for i, f in enumerate(rest, 1):
            if i >= 5:
                with pytest.raises(ConnectionError):  # a failed batch fails each of its calls
                    await f
            elif i % 2:
                with pytest.raises(ValueError, match=f"odd {i}"):  # its own outcome
                    await f
            else:
                assert await f == i * 10
        await c.aclose()
        assert (c.batches, c.items) == (3, 7)
        with pytest.raises(RuntimeError, match="stopping"):
            c.submit(10)

    asyncio.run(run())


def test_an_answer_ends_only_once_the_conductor_has_its_finished(monkeypatch):
    """``Disaggregator.finished`` (awaited before a completion's last bytes): it returns once
    the request's FINISHED is answered, so a conversation's next turn is scheduled with this
    one gone from its node's queue; at most ``REPORT_WAIT_S`` for a conductor that does not
    answer; one FINISHED per request."""
    from concurrent.futures import Future

    from router import disagg
    from router.engines import Engine
    from router.metrics import RouterMetrics

    sent: list[tuple[str, Future]] = []

    def report(ledger_id, phase, prefill_s, transfer_s):
        sent.append((ledger_id, Future()))
        return sent[-1][1]

    async def run() -> None:
        options = disagg.RouterOptions(conductor="127.0.0.1:1", engines=(Engine("n0", "http://x"),))
        d = disagg.Disaggregator(options, RouterMetrics())
        monkeypatch.setattr(d.conductor, "report", report)
        monkeypatch.setattr(disagg, "REPORT_WAIT_S", 0.2)
        try:
            served = disagg.Served(request_id="r", ledger_id="r.1")
            waiting = asyncio.ensure_future(d.finished(served))
            await asyncio.sleep(0.05)
            assert [i for i, _ in sent] == ["r.1"] and not waiting.done()
            sent[0][1].set_result(None)  # the conductor answered
            await asyncio.wait_for(waiting, 1)
            await d.finished(served)  # once per request
            assert d.finish(served) is None and len(sent) == 1
            silent = disagg.Served(request_id="s", ledger_id="s.1")
            t = asyncio.get_running_loop().time()
            await d.finished(silent)  # never answered: the answer ends anyway, soon
            assert 0.15 < asyncio.get_running_loop().time() - t < 1.0
            assert not sent[1][1].cancelled()  # still sent (the entry is freed when it goes)
        finally:
            await d.close()

    asyncio.run(run())
