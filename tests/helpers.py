"""Helpers shared by the tests: polling a real condition with a deadline, and reading the status
of a failed call (a raw stub's ``grpc.RpcError`` or a client's ``KVCacheRpcError``)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import grpc

from rpc.status import KVCacheRpcError

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T],
    timeout_s: float = 15.0,
    what: str = "condition",
    interval_s: float = 0.01,
) -> T:
    """Poll ``probe`` (a real condition: another process, thread or RPC) until it returns a
    truthy value, which is returned; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def rpc_error(fn: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status code and message of the call ``fn`` makes, which must fail."""
    try:
        fn()
    except KVCacheRpcError as e:
        return e.code, e.details
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    raise AssertionError("the call did not fail")
