"""Each trap an operator met, run as a user runs it (a new ``kvcache`` process): the message it
prints and its exit code, never a traceback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import grpc
import pytest

from plumbing.launch import process_identity, start_service
from proto import common_pb2 as cpb
from proto import node_pb2_grpc as pbg

from helpers import kvcache_cli


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr + r.stdout, r.stderr


def test_version():
    r = kvcache_cli("--version")
    assert r.returncode == 0
    assert r.stdout.strip().startswith("kvcache ") and r.stdout.split()[1][0].isdigit()


def test_bash_completion_completes_commands_flags_and_choices(tmp_path):
    r = kvcache_cli("completion", "bash")
    assert r.returncode == 0, r.stderr
    script = tmp_path / "kvcache.bash"
    script.write_text(r.stdout)

    def complete(*words: str) -> list[str]:
        line = " ".join(f'"{w}"' for w in words)
        out = subprocess.run(
            [
                "bash",
                "-c",
                f"source {script}; COMP_WORDS=(kvcache {line}); COMP_CWORD={len(words)}; "
                '_shtab_kvcache; printf "%s\\n" "${COMPREPLY[@]}"',
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    assert complete("st") == ["status"]
    assert "--print-config" in complete("up", "--pr")
    assert complete("up", "--policy", "lo") == ["load", "local-cache"]
    assert "--tokenizer" in complete("bench", "hitrate", "--tok")
    r = kvcache_cli("completion", "fish")
    assert r.returncode == 2 and "invalid choice: 'fish'" in r.stderr


@pytest.mark.parametrize("role", ["node", "conductor", "messenger"])
def test_listen_without_a_port_is_refused(role):
    extra = ["--node", "127.0.0.1:1"] if role == "messenger" else []
    r = kvcache_cli(role, "--listen", "127.0.0.1", *extra)
    assert r.returncode == 2
    assert "argument --listen: expected HOST:PORT" in r.stderr and "'127.0.0.1'" in r.stderr
    no_traceback(r)


def test_a_node_address_without_a_port_is_refused():
    r = kvcache_cli("node", "--conductor", "conductor.local")
    assert r.returncode == 2 and "argument --conductor: expected HOST:PORT" in r.stderr


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("role", ["node", "conductor"])
def test_a_metrics_port_in_use_is_a_message(role, busy_port):
    extra = ["--dram", "4MiB"] if role == "node" else []
    r = kvcache_cli(role, "--metrics-port", str(busy_port), *extra, timeout=60)
    assert r.returncode == 1
    assert f"kvcache {role}: cannot serve metrics on 127.0.0.1:{busy_port}" in r.stderr
    assert "Address already in use" in r.stderr
    no_traceback(r)


def test_up_names_the_process_that_could_not_start(tmp_path, busy_port):
    config = tmp_path / "c.toml"
    config.write_text(
        f'[cluster]\nstate_dir = "{tmp_path / "st"}"\n[defaults]\ndram = "4MiB"\n'
        f'[[node]]\nid = "n0"\nrole = "both"\nmetrics_port = {busy_port}\n'
    )
    r = kvcache_cli("up", "--config", str(config), "--detach", timeout=120)
    assert r.returncode == 1
    assert "kvcache up: the cluster did not start" in r.stderr
    assert f"cannot serve metrics on 127.0.0.1:{busy_port}" in r.stderr
    no_traceback(r)
    assert not (tmp_path / "st" / "cluster.json").exists()  # the conductor was stopped again


def test_down_with_nothing_to_stop_says_where_it_looked(tmp_path):
    r = kvcache_cli("down", "--state-dir", "out/cluster", cwd=str(tmp_path))
    assert r.returncode == 1
    assert f"no cluster state at {tmp_path}/out/cluster/cluster.json" in r.stderr
    assert "nothing was stopped" in r.stderr
    r = kvcache_cli("down", cwd=str(tmp_path), env={"KVCACHE_STATE_DIR": str(tmp_path / "x")})
    assert r.returncode == 1
    assert f"{tmp_path}/x/cluster.json (state dir from $KVCACHE_STATE_DIR)" in r.stderr


def test_down_leaves_a_reused_pid_alone(tmp_path):
    """cluster.json names a pid whose process is gone and whose number another program now
    has: down must not signal it."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorded = {**process_identity(other.pid), "started": 1.0}  # an earlier process
        state = {
            "conductor": {"address": "127.0.0.1:1", "pid": other.pid},
            "nodes": [],
            "pids": [other.pid],
            "processes": [{"pid": other.pid, "role": "conductor", **recorded}],
        }
        (tmp_path / "cluster.json").write_text(json.dumps(state))
        r = kvcache_cli("down", "--state-dir", str(tmp_path), "--timeout", "2")
        assert r.returncode == 1
        assert f"pid {other.pid} (conductor) is now another process" in r.stderr
        assert "not signalled" in r.stderr
        assert other.poll() is None  # still running
    finally:
        other.kill()
        other.wait()


def test_down_stops_only_what_it_started(tmp_path):
    """A real conductor recorded with its identity is stopped."""
    sp = start_service(["conductor"], new_session=True)
    state = {
        "conductor": {"address": sp.address, "pid": sp.pid},
        "nodes": [],
        "pids": [sp.pid],
        "processes": [{"pid": sp.pid, "role": "conductor", **process_identity(sp.pid)}],
    }
    (tmp_path / "cluster.json").write_text(json.dumps(state))
    try:
        r = kvcache_cli("down", "--state-dir", str(tmp_path))
        assert r.returncode == 0, r.stderr
        assert "cluster stopped (1 processes)" in r.stdout
        assert sp.proc.wait(10) == 0
    finally:
        sp.stop()


def test_json_logs_one_event_per_line_with_node_and_request_id(tmp_path):
    node = start_service(
        [
            "node",
            "--dram",
            "4MiB",
            "--node-id",
            "n-log",
            "--log-format",
            "json",
            "--log-level",
            "debug",
        ],
        log_dir=str(tmp_path),
    )
    try:
        with grpc.insecure_channel(node.address) as ch:
            stub = pbg.NodeServiceStub(ch)
            with pytest.raises(grpc.RpcError):
                stub.Lookup(
                    cpb.BlockSelector(namespace="nope"),
                    metadata=[("x-request-id", "req-42")],
                    timeout=10,
                )
    finally:
        node.stop()
    lines = [ln for ln in node.log().splitlines() if ln.strip()]
    events = [json.loads(ln) for ln in lines]  # every line is one JSON event
    failed = [e for e in events if e["request_id"] == "req-42"]
    assert failed, lines
    assert failed[0]["node_id"] == "n-log" and failed[0]["role"] == "node"
    assert failed[0]["rpc"] == "Lookup" and "INVALID_ARGUMENT" in failed[0]["msg"]
    assert all(e["node_id"] == "n-log" for e in events if e["logger"].startswith("kvcache"))


def test_text_logs_keep_a_traceback_on_one_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from rpc.logs import configure_logging, set_identity; import logging\n"
            "configure_logging('INFO', 'text'); set_identity('node', 'n1')\n"
            "try:\n    1 / 0\nexcept ZeroDivisionError:\n"
            "    logging.getLogger('kvcache.x').exception('failed\\nbadly')\n",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
    )
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "ERROR kvcache.x [node n1]: failed\\nbadly" in lines[0]
    assert "ZeroDivisionError" in lines[0]


def test_more_conductor_streams_than_handler_threads_are_refused():
    r = kvcache_cli("conductor", "--workers", "4", "--max-streams", "4")
    assert r.returncode != 0 and "--max-streams must be in [0, --workers) = [0, 4)" in r.stderr
    no_traceback(r)


def test_bad_log_format_is_a_usage_error():
    r = kvcache_cli("conductor", "--log-format", "yaml")
    assert r.returncode == 2 and "argument --log-format: invalid choice: 'yaml'" in r.stderr
