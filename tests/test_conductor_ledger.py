"""A tenant poisoning the conductor's ledger, against a real conductor and node: Schedule calls
of absurd token counts, or many never completed, used to push every node's estimated queue to
days, so that every other tenant's request with an SLO was rejected until the conductor
restarted."""

from __future__ import annotations

import grpc
import pytest

from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from rpc.channel import make_channel

from conftest import TEST_NAMESPACE as NS
from helpers import wait_until

ADMIN, MALLORY, ALICE = "admin-token", "mallory-token", "alice-token"


@pytest.fixture
def cluster(start_kvcache, start_node, tmp_path):
    """A conductor with two tenants and one node registered with it; ``cluster(*flags)`` ->
    the conductor's address."""

    def start(*flags: str) -> str:
        (tmp_path / "admin").write_text(ADMIN + "\n")
        (tmp_path / "tenants").write_text(f"{MALLORY}=mallory\n{ALICE}=alice\n")
        auth = ["--token-file", str(tmp_path / "admin")]
        conductor = start_kvcache(
            "conductor", "--listen", "127.0.0.1:0", *auth,
            "--tenant-tokens-file", str(tmp_path / "tenants"), *flags,
        )  # fmt: skip
        start_node(
            *auth, "--role", "both", "--conductor", conductor.address,
            "--conductor-token-file", str(tmp_path / "admin"),
        )  # fmt: skip
        with make_channel(conductor.address, ADMIN) as channel:
            stub = pbg.ConductorServiceStub(channel)
            wait_until(
                lambda: len(stub.ListNodes(pb.ListNodesRequest(), timeout=5).nodes) == 1,
                what="the node to register",
            )
        return conductor.address

    return start


def schedule(address: str, token: str, rid: str, prompt_tokens: int, ttft_slo_s: float = 0.0):
    with make_channel(address, token) as channel:
        return pbg.ConductorServiceStub(channel).Schedule(
            pb.ScheduleRequest(
                request_id=rid,
                blocks=cpb.BlockSelector(namespace=NS),
                prompt_tokens=prompt_tokens,
                ttft_slo_s=ttft_slo_s,
            ),
            timeout=10,
        )


def code_of(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_absurd_token_counts_are_refused_and_leave_the_queue_alone(cluster):
    address = cluster()
    for i in range(5):  # never completed
        code = code_of(lambda i=i: schedule(address, MALLORY, f"m{i}", 2**32 - 1))
        assert code is grpc.StatusCode.INVALID_ARGUMENT  # OK before: a queue of 2.4 years
    # Another tenant's ordinary request with a 20 s TTFT SLO is admitted.
    reply = schedule(address, ALICE, "a0", 64, ttft_slo_s=20)
    assert reply.est_ttft_s < 20


def test_a_tenant_holds_a_bounded_ledger_that_ages_out(cluster):
    address = cluster("--max-pending-per-tenant", "3", "--pending-timeout", "2")
    context = 131072  # the conductor's default --max-context-tokens: allowed
    for i in range(3):
        schedule(address, MALLORY, f"m{i}", context)
    # A fourth is over the tenant's share of the ledger; other tenants are not.
    assert code_of(lambda: schedule(address, MALLORY, "m3", 64)) is (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert schedule(address, ALICE, "a0", 64).request_id == "a0"
    # Mallory's queue makes an SLO unreachable while it stands (the conductor cannot tell work
    # never sent from work in flight), but it ages out: never completed, it is dropped.
    assert code_of(lambda: schedule(address, ALICE, "a1", 64, ttft_slo_s=20)) is (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    n = iter(range(2, 10**6))
    wait_until(
        lambda: (
            code_of(lambda: schedule(address, ALICE, f"a{next(n)}", 64, ttft_slo_s=20))
            is grpc.StatusCode.OK
        ),
        timeout_s=20,
        interval_s=0.2,
        what="mallory's never-completed requests to age out",
    )
    schedule(address, MALLORY, "m4", 64)  # and mallory's share is free again
