"""``free_port``: the ports ``kvcache up`` tells its services to listen on are picked below the
kernel's ephemeral range, where no connection or port-0 listener started meanwhile (the other
services of the cluster, a test beside it) can take them before the service binds."""

from __future__ import annotations

import socket

from plumbing.launch import ephemeral_ports, free_port, reserve_port


def test_free_ports_are_below_the_ephemeral_range_and_free():
    lo, hi = ephemeral_ports()
    assert 1024 <= lo <= hi
    ports = {free_port("127.0.0.1") for _ in range(50)}
    assert all(1024 <= p < lo for p in ports), sorted(ports)
    assert len(ports) > 40  # at random, not one after another
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free, as promised


def test_a_port_in_use_is_not_picked():
    held = []
    try:
        for _ in range(20):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port("127.0.0.1")))
            s.listen()
            held.append(s)
        taken = {s.getsockname()[1] for s in held}
        assert len(taken) == 20
        assert not taken & {free_port("127.0.0.1") for _ in range(1000)}
    finally:
        for s in held:
            s.close()


def test_a_server_on_a_port_another_server_holds_refuses_to_start(start_node):
    """gRPC binds with SO_REUSEPORT by default, so a second node of the same user on a port
    another node serves used to start and take a share of its connections (a test that stopped
    one node saw its calls answered by the other). Now it exits, saying why."""
    import subprocess
    import sys

    from conftest import TEST_LAYOUT

    node = start_node()
    kvcache = [sys.executable, "-c", "from kvcache.cli import main; raise SystemExit(main())"]
    second = subprocess.run(
        [*kvcache, "node", "--listen", node.address, "--dram", "1MiB", "--layout", TEST_LAYOUT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode != 0
    assert f"kvcache node: cannot listen on {node.address}" in second.stderr


def test_a_reserved_port_is_taken_for_other_picks_and_free_for_its_server():
    """An engine's port is picked long before vLLM binds it: meanwhile no other pick (in any
    process) may get it, and vLLM, which binds with SO_REUSEADDR, must."""
    held = reserve_port("127.0.0.1")
    try:
        with socket.socket() as other:  # what free_port's probe, or any plain bind, does
            try:
                other.bind(("127.0.0.1", held.port))
                raise AssertionError("a reserved port was bound by another socket")
            except OSError:
                pass
        assert free_port("127.0.0.1") != held.port
        with socket.socket() as server:  # as vLLM's create_server_socket does
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", held.port))
            server.listen()
    finally:
        held.release()
    with socket.socket() as after:
        after.bind(("127.0.0.1", held.port))  # released: free for anyone
