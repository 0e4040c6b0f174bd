"""The demo path end to end, as a user runs it: ``kvcache up --detach``, ``kvcache bench live``,
``kvcache down`` (real processes, shared memory, messengers' TCP), and ``kvcache up`` in the
foreground stopped by Ctrl-C. Each cluster gets its own state_dir under tmp_path (config file)."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time

import pytest

from bench.replay.trace import DEFAULT_TRACE

PAGE_BYTES = 256 << 10  # the embedded demo layout: 4 layers x K|V x 512 x 1 x 32 x fp16
BLOCK = 512


def kvcache(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def write_config(tmp_path, dram: str = "256MiB") -> tuple[str, str]:
    state = tmp_path / "state"
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\nstate_dir = "{state}"\n\n[defaults]\ndram = "{dram}"\n')
    return str(config), str(state)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def assert_nothing_left(state: dict) -> None:
    pids = [state["conductor"]["pid"]] + [p for n in state["nodes"] for p in n["pids"]]
    assert len(pids) == 7
    assert [p for p in pids if alive(p)] == []
    shm = [name for n in state["nodes"] for name in n["shm"].values()]
    assert len(shm) == 3
    assert [name for name in shm if os.path.exists(f"/dev/shm/{name}")] == []


# Sessions whose later turns repeat earlier prompts (hash ids name prefixes, 512-token blocks):
# (hash_ids, input_length). Expected full-block prefix hits are computed from the ids below.
SESSIONS = [
    ([1, 2, 3, 4], 4 * BLOCK),  # new
    ([10, 11, 12], 3 * BLOCK - 100),  # new; partial last block (not cached)
    ([1, 2, 3, 4, 5, 6], 6 * BLOCK),  # repeats the first prompt: 4 hits
    ([30], 300),  # shorter than one block: nothing to cache
    ([1, 2, 7], 3 * BLOCK),  # shares 2 blocks with the first
    ([20, 21, 22, 23, 24, 25, 26, 27], 8 * BLOCK),
    ([10, 11, 12, 13], 4 * BLOCK),  # the second's 2 full blocks (its 3rd was partial)
    ([20, 21, 22, 23, 24, 25, 26, 27, 28, 29], 10 * BLOCK - 1),  # 8 hits
    ([40, 41], 2 * BLOCK),  # new
    ([1, 2, 3, 4, 5, 6, 8], 7 * BLOCK),  # 6 hits
]


def expected_hits() -> list[int]:
    """Full-block prefix hits of each request given every earlier request's full blocks."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for ids, length in SESSIONS:
        full = [tuple(ids[: i + 1]) for i in range(length // BLOCK)]
        n = 0
        while n < len(full) and full[n] in seen:
            n += 1
        out.append(n)
        seen.update(full)
    return out


def write_trace(path) -> None:
    with open(path, "w") as f:
        for i, (ids, length) in enumerate(SESSIONS):
            f.write(
                json.dumps(
                    {
                        "timestamp": i * 2000,
                        "input_length": length,
                        "output_length": 32,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )


def run_live(cluster_json: str, out_dir, *extra: str) -> dict:
    r = kvcache(
        "bench", "live", "--cluster", cluster_json, "--out", str(out_dir), "--no-progress", *extra
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.path.getsize(out_dir / "live.png") > 0
    with open(out_dir / "live.json") as f:
        return json.load(f)


@pytest.mark.slow
def test_demo_path_hits_verified_pages_and_clean_shutdown(tmp_path):
    config, state_dir = write_config(tmp_path)
    up = kvcache("up", "--config", config, "--detach")
    assert up.returncode == 0, up.stdout + up.stderr
    cluster_json = os.path.join(state_dir, "cluster.json")
    with open(cluster_json) as f:
        state = json.load(f)
    try:
        trace = tmp_path / "sessions.jsonl"
        write_trace(trace)
        # One engine, arrivals 200 ms apart: each request finds every earlier one's blocks.
        result = run_live(
            cluster_json,
            tmp_path / "synthetic",
            "--trace",
            str(trace),
            "--speedup",
            "10",
            "--concurrency",
            "1",
            "--reference-runs",
            "2",
            "--reference-bytes",
            "8M",
        )
        summary, requests = result["summary"], result["requests"]
        assert summary["requests"] == summary["scheduled"] == summary["ok"] == len(SESSIONS)
        assert summary["failed"] == summary["rejected"] == 0 and summary["errors"] == {}
        # Scheduled as a front end does: over one ScheduleStream call, in batches.
        calls = summary["schedule_calls"]
        assert calls["streams"] == 1 and calls["requests"] == len(SESSIONS)
        assert 1 <= calls["batches"] <= len(SESSIONS)
        want = expected_hits()
        assert [r["reused_blocks"] for r in requests] == want
        assert [r["total_blocks"] for r in requests] == [n // BLOCK for _, n in SESSIONS]
        assert summary["hit_rate"] == pytest.approx(
            sum(want) / sum(n // BLOCK for _, n in SESSIONS)
        )
        assert summary["hit_vs_ideal"] == pytest.approx(1.0)
        # Every page loaded at prefill or held / pulled at decode was checked byte for byte.
        assert summary["verify_failures"] == 0
        distinct = len({tuple(ids[: i + 1]) for ids, n in SESSIONS for i in range(n // BLOCK)})
        assert summary["verified_pages"] == sum(want) + sum(n // BLOCK for _, n in SESSIONS)
        # The decode node pulled each distinct block once (the messengers' own byte counters).
        assert summary["bytes_source"] == "messenger counters"
        assert summary["decode_bytes"] == distinct * PAGE_BYTES
        assert summary["decode_held"] == sum(want)
        # The messenger bench between the same nodes, in the same run, outside the byte counts.
        assert summary["reference_pair"] == "prefill-0 -> decode-0"
        assert summary["reference_bytes"] == 8 << 20 and len(summary["reference_runs_gbps"]) == 2
        assert summary["decode_vs_reference"] == pytest.approx(
            summary["decode_gbps"] / summary["reference_gbps"]
        )

        # The real trace, time-compressed, several engines at once.
        if os.path.exists(DEFAULT_TRACE):
            real = run_live(
                cluster_json,
                tmp_path / "real",
                "--requests",
                "40",
                "--speedup",
                "20",
                "--concurrency",
                "3",
            )["summary"]
            assert real["scheduled"] == 40 and real["failed"] == 0
            assert real["verify_failures"] == 0 and real["verified_pages"] > 0
            assert real["decode_bytes"] > 0 and real["written_bytes"] > 0
            assert real["reference_gbps"] > 0 and real["decode_vs_reference"] > 0
            assert real["reference_bytes"] == 64 << 20  # a quarter of the nodes' 256 MiB
    finally:
        down = kvcache("down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert "cluster stopped (7 processes)" in down.stdout
    assert not os.path.exists(cluster_json)
    assert_nothing_left(state)


def test_bench_live_without_a_cluster_says_how_to_start_one(tmp_path):
    r = kvcache("bench", "live", "--cluster", str(tmp_path / "nope.json"))
    assert r.returncode == 2
    assert "kvcache up --detach" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_live_rejects_bad_options(tmp_path):
    r = kvcache("bench", "live", "--cluster", str(tmp_path / "nope.json"), "--concurrency", "0")
    assert r.returncode == 2 and "--concurrency must be at least 1" in r.stderr
    r = kvcache("bench", "live", "--cluster", str(tmp_path / "x.json"), "--reference-runs", "-1")
    assert r.returncode == 2 and "--reference-runs must be >= 0" in r.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnot json\n'
    )
    r = kvcache("bench", "live", "--trace", str(bad))
    assert r.returncode == 2 and f"{bad}:2" in r.stderr


def up_in_the_foreground(*args: str, timeout_s: float = 90) -> subprocess.Popen:
    """``kvcache up ARGS`` in its own process group, like a shell job (Ctrl-C sends SIGINT to
    the whole group), once it says the cluster is up."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcache.cli", "up", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    seen, deadline = b"", time.monotonic() + timeout_s
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while b"Ctrl-C stops it" not in seen:
                assert time.monotonic() < deadline, seen.decode()
                if sel.select(1.0):
                    chunk = os.read(proc.stdout.fileno(), 4096)
                    assert chunk, f"kvcache up exited early: {proc.wait()} {proc.stderr.read()}"
                    seen += chunk
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc


def ctrl_c(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGINT to ``up_in_the_foreground``'s group; its exit code (SIGKILL if it hangs)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


@pytest.mark.slow
def test_up_in_the_foreground_stops_on_ctrl_c(tmp_path):
    config, state_dir = write_config(tmp_path, dram="64MiB")
    proc = up_in_the_foreground("--config", config)
    try:
        with open(os.path.join(state_dir, "cluster.json")) as f:
            state = json.load(f)
        assert all(alive(p) for p in state["pids"])
    finally:
        code = ctrl_c(proc)
    assert code == 0, proc.stderr.read().decode()
    assert not os.path.exists(os.path.join(state_dir, "cluster.json"))
    assert_nothing_left(state)


@pytest.mark.slow
def test_up_with_tls_encrypts_and_authenticates_every_link(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rpc.channel import make_channel

    config, state_dir = write_config(tmp_path)
    up = kvcache("up", "--config", config, "--detach", "--tls")
    assert up.returncode == 0, up.stdout + up.stderr
    cluster_json = os.path.join(state_dir, "cluster.json")
    with open(cluster_json) as f:
        state = json.load(f)
    try:
        assert os.stat(cluster_json).st_mode & 0o077 == 0  # it holds the token
        ca, token = state["tls_ca"], state["token"]
        assert ca and token  # --tls brings a generated cluster token with it
        assert os.stat(os.path.join(state_dir, "tls", "server.key")).st_mode & 0o077 == 0
        pids = [state["conductor"]["pid"]] + [p for n in state["nodes"] for p in n["pids"]]
        for pid in pids:  # the token travels in a 0600 file, never on a command line
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert token.encode() not in f.read()
        services = [state["conductor"]["address"]] + [
            a for n in state["nodes"] for a in (n["address"], n["messenger"])
        ]
        for address in services:
            request = health_pb2.HealthCheckRequest()
            with make_channel(address, token, ca) as channel:
                status = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            with grpc.insecure_channel(address) as plain:  # plaintext gets nowhere
                with pytest.raises(grpc.RpcError) as e:
                    health_pb2_grpc.HealthStub(plain).Check(request, timeout=3)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        trace = tmp_path / "sessions.jsonl"
        write_trace(trace)
        summary = run_live(
            cluster_json, tmp_path / "out", "--trace", str(trace), "--speedup", "10"
        )["summary"]
        # Nodes registered with the conductor, which scheduled by their events and had the
        # messengers pull pages from each other: every link verified the CA.
        assert summary["ok"] == len(SESSIONS) and summary["errors"] == {}
        assert summary["verify_failures"] == 0 and summary["decode_bytes"] > 0
    finally:
        down = kvcache("down", "--state-dir", state_dir)
    assert down.returncode == 0, down.stdout + down.stderr
    assert_nothing_left(state)
