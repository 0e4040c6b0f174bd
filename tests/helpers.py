"""Helpers shared by the tests: polling a real condition with a deadline, reading the status
of a failed call (a raw stub's ``grpc.RpcError`` or a client's ``KVCacheRpcError``), running
the ``kvcache`` command as a user would, counting the RPCs a node served, and a node client that
keeps what its commits sent."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable, TypeVar

import grpc
import numpy as np

from clients.node_client import CommitResult, KVStoreClient, WriteLease
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


def rpc_calls(service: Any, method: str, code: str | None = None) -> int:
    """How many ``method`` calls a node (started with ``--metrics-port``) served, from its
    Prometheus metrics; with ``code``, how many of them failed with that status code."""
    port = service.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    if code is None:
        name, labels = "kvcache_node_rpc_seconds_count", f'method="{method}"'
    else:
        name, labels = "kvcache_node_rpc_errors_total", f'code="{code}",method="{method}"'
    m = re.search(rf"^{name}\{{{labels}\}} ([0-9.e+]+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def kvcache_cli(
    *args: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``kvcache ARGS`` as a user would (a new process); ``env`` adds to an environment
    without any ``KVCACHE_*`` variable of the test runner's."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_")}
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**base, **(env or {})},
        cwd=cwd,
    )


class CommitLog(KVStoreClient):
    """A real node client that also keeps each commit's lease and the checksums it sent (None:
    none), to see what a writer built on it (the messenger's mover) hands the node."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commits: list[tuple[WriteLease, np.ndarray | None]] = []

    def commit(self, lease: WriteLease, checksums: Any = None, hold_s: float = 0.0) -> CommitResult:
        sent = None if checksums is None else np.asarray(checksums, dtype=np.uint64).copy()
        self.commits.append((lease, sent))
        return super().commit(lease, checksums, hold_s)


def full_computation(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy output token ids of a vLLM server at ``url`` for each prompt (token ids), computed
    in full: each request under a ``cache_salt`` of its own, so neither the engine's prefix
    cache nor a KV connector (its keys carry the salt) has anything to load. What a
    connector-less engine computes, without starting one more engine."""
    out = []
    for prompt in prompts:
        body = {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": f"full-computation-{secrets.token_hex(8)}", "return_token_ids": True,
        }  # fmt: skip
        ask = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(ask, timeout=300) as r:
            out.append(json.loads(r.read())["choices"][0]["token_ids"])
    return out


def sigstop(pid: int) -> None:
    """SIGSTOP ``pid`` and return once every thread of it is stopped: the signal takes effect
    as each thread next runs, and a thread of a busy machine's process could still answer a
    message sent at once."""
    os.kill(pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                continue  # a thread that ended
            if state not in ("T", "t"):
                return False
        return True

    wait_until(all_stopped, 10, f"process {pid} to stop")
