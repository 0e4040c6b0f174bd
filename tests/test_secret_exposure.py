"""Where a token can leak on a host: other users read every process's command line
(/proc/PID/cmdline), the same user every process's environment (/proc/PID/environ, handed on to
each child), and a file rewritten in place keeps whatever permissions it had. Real processes, as
``kvcache up`` and an operator start them."""

from __future__ import annotations

import json
import os

import pytest

from helpers import kvcache_cli

SECRET = "do-not-leak-this-admin-token"


def test_tokens_given_on_the_command_line_are_warned_about(start_node, start_kvcache, tmp_path):
    node = start_node("--token", SECRET, "--tenant-token", "tenant-secret=alice")
    log = node.log()
    assert "--token was given on the command line" in log and "--token-file" in log
    assert "--tenant-token was given on the command line" in log
    assert "--tenant-tokens-file" in log
    router = start_kvcache(
        "router", "--listen", "127.0.0.1:0", "--conductor", node.address,
        "--engine", "n=http://127.0.0.1:1", "--api-key", "router-secret",
    )  # fmt: skip
    assert "--api-key was given on the command line" in router.log()
    # In files, nothing to warn about.
    (tmp_path / "token").write_text(SECRET + "\n")
    quiet = start_node("--token-file", str(tmp_path / "token"))
    assert "given on the command line" not in quiet.log()


def test_a_server_open_to_the_network_says_so(start_node):
    # With no token every caller is the admin: fine on loopback, worth a warning elsewhere.
    exposed = start_node("--listen", "0.0.0.0:0")
    assert "without a token: every caller who reaches it is the admin" in exposed.log()
    local = start_node()
    assert "without a token" not in local.log()


@pytest.mark.slow
def test_a_cluster_keeps_its_token_out_of_environments_and_loose_files(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    # Files of an earlier run, world-readable (a user's umask, a copy): rewritten, they were
    # left readable by everyone, the new token in them.
    for name, text in (("token", "old\n"), ("cluster.json", '{"pids": []}')):
        (state_dir / name).write_text(text)
        (state_dir / name).chmod(0o644)
    config = tmp_path / "cluster.toml"
    config.write_text(f'[cluster]\nstate_dir = "{state_dir}"\n\n[defaults]\ndram = "16MiB"\n')
    up = kvcache_cli("up", "--config", str(config), "--detach", env={"KVCACHE_TOKEN": SECRET})
    assert up.returncode == 0, up.stdout + up.stderr
    assert "no TLS: every link in clear" in up.stdout  # it says what protects it, and what not
    try:
        with open(state_dir / "cluster.json") as f:
            state = json.load(f)
        assert state["token"] == SECRET  # the token is the cluster's ($KVCACHE_TOKEN)
        for name in ("token", "data-token", "cluster.json"):
            assert os.stat(state_dir / name).st_mode & 0o777 == 0o600, name
        assert state["pids"]
        for pid in state["pids"]:
            for what in ("environ", "cmdline"):
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    assert SECRET.encode() not in f.read(), (pid, what)
    finally:
        down = kvcache_cli("down", "--state-dir", str(state_dir))
    assert down.returncode == 0, down.stdout + down.stderr
