"""Shared fixtures: real kvcache processes on loopback ports, cleaned up after each test."""

from __future__ import annotations

import os
import tempfile

import pytest

from plumbing.launch import ServiceProcess, start_service

import leftovers

# 8 KiB pages: 2 layers x K|V x 16 tokens x 2 heads x 32 dims x fp16.
TEST_LAYOUT = "model=test,num_layers=2,kv_heads=2,head_dim=32,dtype=float16,block_tokens=16"
TEST_NAMESPACE = "test|L2|H2|D32|float16|B16"
TEST_PAGE_BYTES = 8192
TEST_BLOCK_TOKENS = 16


@pytest.fixture(scope="session", autouse=True)
def _private_tmp(tmp_path_factory):
    """Temporary files of the run (logs of services started with no log directory, the test
    engines' logs and fork server, what vLLM and its children write) go under pytest's own base
    temporary directory, which pytest prunes, not loose in /tmp."""
    tmp = tmp_path_factory.getbasetemp() / "tmp"
    tmp.mkdir(exist_ok=True)
    os.environ["TMPDIR"] = tempfile.tempdir = str(tmp)
    yield


@pytest.fixture
def start_kvcache(tmp_path):
    """``start_kvcache("node", "--dram", "1MiB", ...)`` -> ServiceProcess; stopped at teardown."""
    started: list[ServiceProcess] = []

    def start(
        *args: str,
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        wrap: list[str] | None = None,
    ) -> ServiceProcess:
        sp = start_service(
            list(args), timeout_s=timeout_s, log_dir=str(tmp_path), env=env, wrap=wrap
        )
        started.append(sp)
        return sp

    yield start
    for sp in reversed(started):
        sp.stop()


@pytest.fixture
def start_node(start_kvcache, tmp_path):
    """A node server with the 8 KiB test layout; extra flags pass through."""

    def start(
        *extra: str, dram: str = "1MiB", layout: str = TEST_LAYOUT, wrap: list[str] | None = None
    ) -> ServiceProcess:
        return start_kvcache(
            "node", "--listen", "127.0.0.1:0", "--dram", dram, "--layout", layout, *extra, wrap=wrap
        )

    return start


def shm_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd member (Debian's etcd-server, which make installs) on free loopback ports,
    its data in tmp_path/etcd; stopped at teardown (restarts through ``.restart()`` included)."""
    from kvcache.etcd_server import start_etcd

    servers = [start_etcd(str(tmp_path / "etcd"), log_path=str(tmp_path / "etcd.log"))]

    class Handle:
        @property
        def server(self):
            return servers[-1]

        @property
        def endpoint(self) -> str:
            return servers[-1].endpoint

        def kill(self) -> None:
            servers[-1].kill()

        def restart(self):
            servers.append(servers[-1].restart())
            return servers[-1]

    yield Handle()
    for s in servers:
        s.stop()


# ---- nothing left behind ---------------------------------------------------------------------
# tests/leftovers.py: processes of this run, /dev/shm entries nobody holds, network namespaces
# and links with this run's prefix. Checked after every module and at the end; what is found is
# reported, removed, and fails the run.
leftovers.start_worker()
_BASELINE = leftovers.Baseline.take()


# The longest modules here (a minute or more each: vLLM engines, clusters, namespaced hosts),
# longest first. Order only: nothing is left out.
_LONGEST = [  # by their summed test times in a full run (2026-11-27)
    "test_serving",
    "test_vllm_connector_cases",
    "test_messenger_limits",
    "test_messenger_service",
    "test_hosts_netns",
    "test_serving_chat",
    "test_etcd_cluster",
    "test_node_server",
    "test_vllm_pool",
    "test_vllm_connector",
    "test_cluster_e2e",
    "test_sglang_hicache",
    "test_router",
    "test_vllm_connector_roles",
    "test_dependency_range",
]


def pytest_collection_modifyitems(config, items):
    """The longest modules first, then those with slow tests: under ``pytest -n 2 --dist
    loadfile`` (a module on one worker, its module-scoped clusters started once) the workers
    then end together rather than one waiting on another's last long module."""
    slow = {_module(item) for item in items if item.get_closest_marker("slow") is not None}

    def rank(item) -> int:
        name = _module(item)
        if name in _LONGEST:
            return _LONGEST.index(name)
        return len(_LONGEST) + (name not in slow)

    items.sort(key=rank)  # stable: a module stays together, in its own order


def _module(item) -> str:
    return item.module.__name__ if getattr(item, "module", None) is not None else item.nodeid


@pytest.fixture(scope="module", autouse=True)
def _nothing_left_behind(request):
    _BASELINE.shm = leftovers.shm_entries()  # only what appears during the module is its own
    yield
    found = _BASELINE.find()
    if found:
        _BASELINE.clean(found)
        pytest.fail(f"{request.module.__name__} left behind:\n{found.report()}", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    found = _BASELINE.find()
    if found:
        _BASELINE.clean(found)
        session.config.get_terminal_writer().line(f"\nthe test run left behind:\n{found.report()}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
