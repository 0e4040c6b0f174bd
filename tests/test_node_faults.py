"""A node process meeting faults of its host: a full SSD filesystem, a small /dev/shm, a damaged
lmdb file, other processes' shared memory. Each gets a clear error or keeps serving; never a crash,
a traceback or a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from clients import KVStoreClient
from kvstore.shm import shm_free_bytes

from conftest import TEST_LAYOUT, TEST_PAGE_BYTES
from kvstore_helpers import REPO_ROOT, small_tmpfs


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of the node's Prometheus metrics, by name and labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, name + "_total") and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"{name}{labels} not in the node's metrics")


def test_a_node_with_a_full_ssd_filesystem_keeps_taking_writes(start_node, tmp_path):
    with small_tmpfs(tmp_path / "ssd") as ssd_dir:
        node = start_node(
            "--ssd", "4MiB", "--ssd-dir", str(ssd_dir), "--metrics-port", "0", dram="64KiB"
        )
        port = node.info["metrics_port"]
        with KVStoreClient(node.address) as c:
            ns = c.namespaces()[0]

            def put(i: int) -> None:
                page = np.full(TEST_PAGE_BYTES, i % 251, np.uint8)
                assert c.put(ns, [page], keys=[i.to_bytes(16, "little")]).stored == 1

            for i in range(120):  # 8 pages of DRAM; the filesystem fills after ~60
                put(i)
            failures = metric(port, "kvcache_store_demotion_failures", namespace=ns)
            assert failures > 0
            (ssd_dir / "ballast").unlink()  # space returns: demotion resumes
            demoted = metric(port, "kvcache_store_tier_moves", namespace=ns, direction="demote")
            for i in range(120, 130):
                put(i)
            assert metric(port, "kvcache_store_demotion_failures", namespace=ns) == failures
            moves = metric(port, "kvcache_store_tier_moves", namespace=ns, direction="demote")
            assert moves == demoted + 10
            assert c.get(ns, keys=[(125).to_bytes(16, "little")])[0][0] == 125
        assert node.alive()
        assert node.stop() == 0
        assert "Traceback" not in node.log()


def run_node_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``kvcache node ARGS`` that is expected to exit by itself (refusing to start)."""
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "node", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("flags", [(), ("--no-reserve-shm",), ("--reserve-shm",)])
def test_dram_beyond_the_free_shared_memory_is_refused_at_start(flags):
    free = shm_free_bytes()
    if free is None:
        pytest.skip("/dev/shm has no size limit here")
    dram = free + (1 << 30)  # sparse: creating it would work, and writes would later SIGBUS
    proc = run_node_cli("--dram", str(dram), *flags)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert "--dram needs" in proc.stderr and "/dev/shm has only" in proc.stderr
    assert "lower --dram" in proc.stderr


def test_a_node_refuses_a_damaged_ssd_file_unless_told_to_move_it_aside(start_node, tmp_path):
    ssd = ["--ssd", "1MiB", "--ssd-dir", str(tmp_path / "ssd")]
    node = start_node(*ssd)
    shm = Path("/dev/shm") / next(iter(node.info["shm"].values()))
    assert shm.stat().st_mode & 0o777 == 0o600
    with KVStoreClient(node.address) as c:  # NOTE: serving, so a SIGTERM now stops it cleanly
        c.namespaces()
    node.stop()
    [data] = (tmp_path / "ssd").glob("*/data.mdb")
    assert data.stat().st_mode & 0o777 == 0o600
    os.truncate(data, 8192)  # the meta pages only: the first read of the tree was a SIGBUS
    proc = run_node_cli("--dram", "1MiB", "--layout", TEST_LAYOUT, *ssd)
    assert proc.returncode == 1 and proc.stdout == "" and "Traceback" not in proc.stderr
    assert "is damaged" in proc.stderr and "--ssd-damaged=move-aside" in proc.stderr
    node = start_node(*ssd, "--ssd-damaged", "move-aside")
    assert [p.name[:17] for p in data.parent.glob("data.mdb.damaged-*")] == ["data.mdb.damaged-"]
    assert "moved it to" in node.log()


# ---- /dev/shm filled by another process after the node started ---------------------------------


@contextmanager
def private_dev_shm(size: str) -> Iterator[list[str]]:
    """A mount namespace of its own with a ``size`` tmpfs on /dev/shm (root only, else the test
    is skipped). Yields the command prefix that runs a process in it (``nsenter``: same pid).
    Filling that /dev/shm fills this small tmpfs, never the machine's; the tmpfs goes with the
    last process of the namespace."""
    holder = subprocess.Popen(
        [
            *("unshare", "--mount", "--propagation", "private", "sh", "-c"),
            f"mount -t tmpfs -o size={size},mode=1777 kvtest-shm /dev/shm && echo ready "
            "&& exec cat >/dev/null",  # lives until the test closes its stdin
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert holder.stdin is not None and holder.stdout is not None and holder.stderr is not None
    try:
        if holder.stdout.readline().strip() != "ready":
            holder.stdin.close()
            pytest.skip(f"cannot mount a private /dev/shm (needs root): {holder.stderr.read()}")
        yield ["nsenter", "-t", str(holder.pid), "-m", "--"]
    finally:
        if not holder.stdin.closed:
            holder.stdin.close()
        holder.wait(10)


FILL_SHM = """
import errno, os
fd = os.open("/dev/shm/kvtest-filler", os.O_WRONLY | os.O_CREAT, 0o600)
n = 0
try:
    while True:
        n += os.write(fd, b"\1" * 65536)
except OSError as e:
    assert e.errno == errno.ENOSPC, e
print(n)
"""

# A same-host client: stores pages through the node's shared memory and through the stream
# (the node writes them), reads them back both ways. Prints each operation's outcome: true, or
# the status code it failed with.
WRITE_AND_READ = """
import json, sys
import numpy as np
from clients import KVStoreClient
from rpc.status import KVCacheRpcError
address, token, n = sys.argv[1], sys.argv[2] or None, int(sys.argv[3])
pages = np.random.default_rng(0).integers(0, 256, (2 * n, int(sys.argv[4])), dtype=np.uint8)
keys = [i.to_bytes(16, "little") for i in range(2 * n)]
out = {}
def attempt(name, fn):
    try:
        out[name] = bool(fn())
    except KVCacheRpcError as e:
        out[name] = "status " + e.code.name
with KVStoreClient(address, token) as c, KVStoreClient(address, token, use_shm=False) as remote:
    ns = c.namespaces()[0]
    assert c.shm_available(ns)
    same = lambda got, want: all(g is not None and np.array_equal(g, w) for g, w in zip(got, want))
    attempt("shm put", lambda: c.put(ns, list(pages[:n]), keys=keys[:n]).stored == n)
    attempt("streamed put", lambda: remote.put(ns, list(pages[n:]), keys=keys[n:]).stored == n)
    attempt("shm get", lambda: same(c.get(ns, keys=keys), pages))
    attempt("streamed get", lambda: same(remote.get(ns, keys=keys), pages))
print(json.dumps(out))
"""


@pytest.mark.parametrize("tenants", [False, True], ids=["shm-by-name", "tenant-memfds"])
def test_shared_memory_filled_by_another_process_after_start_kills_nobody(start_node, tenants):
    """The node reserves its DRAM pool at start: when another process fills /dev/shm later, the
    node's writes and a same-host client's writes into the pool still have their pages (with a
    sparse pool, the first write into a page not backed yet was a SIGBUS: node or client died).
    With tenants, no memory is in /dev/shm at all (memfds)."""
    # NOTE: the client reads 96 of the 128 pages at once: more than a tenant's default share.
    auth = (
        ("--token", "admin", "--tenant-token", "tok-a=alice", "--tenant-lease-share", "1")
        if tenants
        else ()
    )
    with private_dev_shm("4m") as in_ns:
        node = start_node(*auth, dram="1MiB", wrap=in_ns)  # 128 pages of the 4 MiB
        fill = subprocess.run(
            [*in_ns, sys.executable, "-c", FILL_SHM], capture_output=True, text=True, timeout=60
        )
        try:
            assert fill.returncode == 0, fill.stderr
            assert int(fill.stdout) > 0  # /dev/shm is full now
            client = subprocess.run(
                [*in_ns, sys.executable, "-c", WRITE_AND_READ, node.address]
                + ["tok-a" if tenants else "", "48", str(TEST_PAGE_BYTES)],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            )
            assert client.returncode == 0, (client.returncode, client.stderr[-2000:])
            assert node.alive(), node.log()[-2000:]
            outcomes = json.loads(client.stdout)
            assert outcomes == dict.fromkeys(
                ["shm put", "streamed put", "shm get", "streamed get"], True
            )
        finally:
            subprocess.run([*in_ns, "rm", "-f", "/dev/shm/kvtest-filler"], check=False)
        assert node.stop() == 0
        assert "Traceback" not in node.log()
