"""The conductor as users see it: a real `kvcache conductor` process, real `kvcache node` processes
registering with it (their agents heartbeat; the conductor reads their Events streams), the client
library writing blocks, and raw gRPC for the bad inputs."""

from __future__ import annotations

import os
import re
import signal
import threading
import urllib.request
from concurrent import futures

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from clients import KVStoreClient
from clients.conductor_client import ConductorClient, selector
from kvstore.errors import InvalidArgument
from kvstore.keys import block_keys, root_key, scope_keys
from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from proto import conductor_pb2_grpc as pbg
from proto import node_pb2 as npb
from proto import node_pb2_grpc as npbg
from rpc.channel import make_channel
from rpc.wire import transfer_keys

from conftest import TEST_BLOCK_TOKENS, TEST_LAYOUT, TEST_NAMESPACE, TEST_PAGE_BYTES
from helpers import rpc_error, sigstop, wait_until

NS = TEST_NAMESPACE
BT = TEST_BLOCK_TOKENS


def tokens(n_blocks: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n_blocks * BT, dtype=np.int64)


def pages(n: int) -> list[np.ndarray]:
    return [np.full(TEST_PAGE_BYTES, i % 251, np.uint8) for i in range(n)]


def node_ids(cc: ConductorClient) -> set[str]:
    return {n.node.node_id for n in cc.list_nodes().nodes}


@pytest.fixture
def start_conductor(start_kvcache):
    def start(*extra: str):
        return start_kvcache("conductor", "--listen", "127.0.0.1:0", *extra)

    return start


@pytest.fixture
def start_member(start_node):
    """A node server that registers with a conductor."""

    def start(conductor, node_id: str, role: str, *extra: str, dram: str = "1MiB"):
        return start_node(
            "--conductor",
            conductor.address,
            "--node-id",
            node_id,
            "--role",
            role,
            *extra,
            dram=dram,
        )

    return start


# ---- the conductor alone ------------------------------------------------------------------------


def test_health_reflection_and_bad_requests(start_conductor):
    c = start_conductor()
    channel = make_channel(c.address)
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="kvcache.v1.ConductorService"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    reply = next(
        refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    )
    assert "kvcache.v1.ConductorService" in {s.name for s in reply.list_services_response.service}

    stub = pbg.ConductorServiceStub(channel)
    with ConductorClient(c.address) as cc:
        code, msg = rpc_error(lambda: cc.schedule(NS, tokens=tokens(2)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no registered node" in msg
        code, msg = rpc_error(lambda: cc.schedule("", tokens=tokens(2)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "namespace is required" in msg
        code, msg = rpc_error(lambda: cc.complete("never-scheduled"))
        assert code == grpc.StatusCode.NOT_FOUND and "never-scheduled" in msg
    code, msg = rpc_error(
        lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(node=pb.NodeDescriptor(node_id="n1")), timeout=5
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "address is required" in msg
    code, msg = rpc_error(
        lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(
                node=pb.NodeDescriptor(node_id="bad id!", address="127.0.0.1:1")
            ),
            timeout=5,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "node id" in msg
    code, msg = rpc_error(
        lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(
                node=pb.NodeDescriptor(node_id="n1", address="127.0.0.1:1", role=9)
            ),
            timeout=5,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "role" in msg
    code, msg = rpc_error(
        lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(
                node=pb.NodeDescriptor(
                    node_id="n1",
                    address="127.0.0.1:1",
                    layouts=[cpb.Layout(model="m", num_layers=0, kv_heads=1, head_dim=1)],
                )
            ),
            timeout=5,
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "num_layers" in msg
    code, msg = rpc_error(lambda: stub.Heartbeat(pb.HeartbeatRequest(node_id="ghost"), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND and "register again" in msg
    assert c.alive()


def test_calls_in_flight_wait_for_the_few_handler_threads(start_conductor):
    """A handful of handler threads serve the calls in turn: 300 at once (every node's
    heartbeat and every front end's call may come together) are served, none refused."""
    c = start_conductor("--workers", "2")
    channel = make_channel(c.address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        calls = [stub.Check.future(health_pb2.HealthCheckRequest(), timeout=60) for _ in range(300)]
        assert {f.result().status for f in calls} == {health_pb2.HealthCheckResponse.SERVING}
    finally:
        channel.close()


def test_auth_token_and_tenant_permissions(start_conductor):
    c = start_conductor("--token", "admin-secret", "--tenant-token", "t1=alice")
    no_token = pbg.ConductorServiceStub(make_channel(c.address))
    code, msg = rpc_error(lambda: no_token.ListNodes(pb.ListNodesRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in msg
    tenant = pbg.ConductorServiceStub(make_channel(c.address, "t1"))
    assert tenant.ListNodes(pb.ListNodesRequest(), timeout=5).policy == "global-cache"
    code, msg = rpc_error(
        lambda: tenant.RegisterNode(
            pb.RegisterNodeRequest(node=pb.NodeDescriptor(node_id="n1", address="127.0.0.1:1")),
            timeout=5,
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED and "admin token" in msg
    # Health stays open for probes without a token.
    health = health_pb2_grpc.HealthStub(make_channel(c.address))
    assert (
        health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        == health_pb2.HealthCheckResponse.SERVING
    )


# ---- a cluster of real nodes --------------------------------------------------------------------


def scrape(service, series: str) -> float:
    """One series of a service's Prometheus endpoint (0 when not exported yet)."""
    port = service.info["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search("^" + re.escape(series) + r" ([0-9.e+]+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow
def test_registration_event_fed_index_and_scheduling(start_conductor, start_member):
    c = start_conductor("--metrics-port", "0")
    n0 = start_member(c, "n0", "prefill")
    n1 = start_member(c, "n1", "prefill")
    start_member(c, "d0", "decode")
    with (
        ConductorClient(c.address) as cc,
        KVStoreClient(n0.address) as k0,
        KVStoreClient(n1.address) as k1,
    ):
        wait_until(lambda: node_ids(cc) == {"n0", "n1", "d0"}, what="three registrations")
        listed = {n.node.node_id: n for n in cc.list_nodes().nodes}
        assert listed["n0"].node.role == pb.NODE_ROLE_PREFILL
        assert listed["d0"].node.role == pb.NODE_ROLE_DECODE
        assert listed["n0"].node.address == n0.address
        assert [l.block_tokens for l in listed["n0"].node.layouts] == [BT]
        assert {t.tier for t in listed["n0"].node.capacity} == {cpb.TIER_DRAM}

        # Puts on the nodes reach the conductor's index through their event streams.
        prompt = tokens(12)
        assert k0.put(NS, pages(12), tokens=prompt).stored == 12
        assert k1.put(NS, pages(3), tokens=prompt[: 3 * BT]).stored == 3
        wait_until(
            lambda: cc.locate(NS, tokens=prompt) == {"n0": 12, "n1": 3},
            what="index to show both prefixes",
        )

        # Longest prefix wins when every node is idle.
        r = cc.schedule(NS, tokens=prompt, output_tokens=16, request_id="idle")
        assert (r.prefill_node, r.local_blocks, r.reuse_blocks) == ("n0", 12, 12)
        assert (r.decode_node, r.prefill_address, r.total_blocks) == ("d0", n0.address, 12)
        assert not r.transfers

        # Load n0 with a request it half holds; then a loaded holder loses to an idle fetcher.
        other = tokens(64, start=100_000)
        assert k0.put(NS, pages(32), tokens=other[: 32 * BT]).stored == 32
        wait_until(lambda: cc.locate(NS, tokens=other).get("n0") == 32, what="32 more on n0")
        busy = cc.schedule(NS, tokens=other, request_id="busy")
        assert busy.prefill_node == "n0" and busy.est_prefill_s > 0
        r = cc.schedule(NS, tokens=prompt, request_id="fetch")
        assert (r.prefill_node, r.local_blocks, r.reuse_blocks) == ("n1", 3, 12)
        (plan,) = r.transfers
        assert (plan.src_node, plan.dst_node, plan.first_block) == ("n0", "n1", 3)
        assert (plan.src_address, plan.dst_address) == (n0.address, n1.address)
        expected = block_keys(prompt, BT, root_key(NS))[3:]
        assert plan.key_bytes == b"".join(expected) and not plan.keys  # packed on the wire
        assert transfer_keys(plan) == expected and plan.bytes == 9 * TEST_PAGE_BYTES

        # Rejection names the SLO; the ledger is honest after Complete.
        code, msg = rpc_error(lambda: cc.schedule(NS, tokens=prompt, ttft_slo_s=1e-9))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "TTFT SLO" in msg
        code, msg = rpc_error(lambda: cc.schedule(NS, tokens=prompt, tbt_slo_s=1e-9))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "TBT SLO" in msg
        assert cc.list_nodes().pending_requests == 3
        cc.prefilled("busy", prefill_seconds=0.5)
        for rid in ("idle", "busy", "fetch"):
            cc.complete(rid)
        assert cc.list_nodes().pending_requests == 0
        code, _ = rpc_error(lambda: cc.complete("busy"))
        assert code == grpc.StatusCode.NOT_FOUND

        # A batch gets one outcome per request: placed, rejected, or malformed.
        outcomes = cc.schedule_batch(
            [
                pb.ScheduleRequest(request_id="b1", blocks=selector(NS, tokens=prompt)),
                pb.ScheduleRequest(
                    request_id="b2",
                    blocks=selector(NS, tokens=prompt),
                    prompt_tokens=12 * BT + 5,
                    ttft_slo_s=1e-9,
                ),
                pb.ScheduleRequest(request_id="b3", blocks=selector(NS, keys=[b"short"])),
                pb.ScheduleRequest(request_id="b4", blocks=selector("nobody|serves|this", keys=[])),
            ]
        )
        assert [o.code for o in outcomes] == [
            grpc.StatusCode.OK.value[0],
            grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
            grpc.StatusCode.INVALID_ARGUMENT.value[0],
            grpc.StatusCode.FAILED_PRECONDITION.value[0],
        ]
        assert outcomes[0].reply.request_id == "b1" and outcomes[0].reply.reuse_blocks == 12
        assert "TTFT SLO" in outcomes[1].message and "16 bytes" in outcomes[2].message
        # Completes in a batch: each done or failed on its own, in order.
        assert cc.schedule(NS, tokens=prompt, request_id="b5").request_id == "b5"
        assert cc.list_nodes().pending_requests == 2
        done = cc.complete_batch(
            [
                pb.CompleteRequest(request_id="b1", phase=pb.COMPLETE_PHASE_PREFILLED),
                pb.CompleteRequest(request_id="b1"),
                pb.CompleteRequest(request_id=""),
                pb.CompleteRequest(request_id="b5", prefill_seconds=-1),
                pb.CompleteRequest(request_id="never-scheduled"),
                pb.CompleteRequest(request_id="b5", prefill_seconds=0.2),
            ]
        )
        codes = [grpc.StatusCode.OK, grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT]
        codes += [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OK]
        assert [o.code for o in done] == [c.value[0] for c in codes]
        assert "request_id is required" in done[2].message and ">= 0" in done[3].message
        assert cc.list_nodes().pending_requests == 0
        too_many = [pb.CompleteRequest(request_id="x")] * 1025
        code, msg = rpc_error(lambda: cc.complete_batch(too_many))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 1024" in msg
        code, msg = rpc_error(
            lambda: cc.schedule_batch(
                [pb.ScheduleRequest(blocks=selector(NS, tokens=prompt))] * 1025
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 1024" in msg

        # Removals and evictions reach the index too.
        assert k0.remove(NS, keys=block_keys(prompt, BT, root_key(NS))[8:]) == 4
        wait_until(
            lambda: cc.locate(NS, tokens=prompt) == {"n0": 8, "n1": 3}, what="removals in the index"
        )

    # What happened is visible in the metrics.
    decisions = 'kvcache_conductor_schedule_decisions_total{policy="global-cache",transfer="%s"}'
    assert scrape(c, decisions % "no") == 4 and scrape(c, decisions % "yes") == 1
    assert scrape(c, 'kvcache_conductor_schedule_rejections_total{slo="ttft"}') == 2
    assert scrape(c, 'kvcache_conductor_schedule_rejections_total{slo="tbt"}') == 1
    assert scrape(c, 'kvcache_conductor_nodes{role="prefill"}') == 2
    assert scrape(c, 'kvcache_conductor_resyncs_total{reason="register"}') == 3
    assert scrape(c, "kvcache_conductor_events_total") >= 12 + 3 + 32 + 4


def test_a_stream_answers_each_batch_in_order_and_never_hangs(start_conductor, start_member):
    """ScheduleStream: every batch on one call, answered in order with ScheduleBatch's outcomes
    (one bad item fails only itself); a batch over the limit ends the stream with its status and
    the next batch opens another; a conductor that stops answering costs the client's timeout,
    then DEADLINE_EXCEEDED; a token the conductor does not know is refused on the stream."""
    c = start_conductor()
    start_member(c, "p0", "prefill")
    start_member(c, "d0", "decode")
    ok, bad = grpc.StatusCode.OK.value[0], grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with ConductorClient(c.address, timeout_s=3) as cc:
        wait_until(lambda: node_ids(cc) == {"p0", "d0"}, what="two registrations")
        with cc.schedule_stream() as stream:
            for i in range(3):
                outcomes = stream.schedule_batch(
                    [
                        pb.ScheduleRequest(
                            request_id=f"s{i}a", blocks=selector(NS, tokens=tokens(2))
                        ),
                        pb.ScheduleRequest(
                            request_id=f"s{i}b", blocks=selector(NS, keys=[b"short"])
                        ),
                        pb.ScheduleRequest(
                            request_id=f"s{i}c", blocks=selector(NS, tokens=tokens(3))
                        ),
                    ]
                )
                assert [o.code for o in outcomes] == [ok, bad, ok]
                assert [outcomes[0].reply.request_id, outcomes[2].reply.request_id] == [
                    f"s{i}a",
                    f"s{i}c",
                ]
                assert (outcomes[0].reply.prefill_node, outcomes[0].reply.decode_node) == (
                    "p0",
                    "d0",
                )
                assert "16 bytes" in outcomes[1].message
            assert stream.opened == 1
            assert cc.list_nodes().pending_requests == 6  # in the ledger, as a unary call's
            over = [pb.ScheduleRequest(blocks=selector(NS, tokens=tokens(1)))] * 1025
            code, msg = rpc_error(lambda: stream.schedule_batch(over))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "limit is 1024" in msg
            (again,) = stream.schedule_batch(
                [pb.ScheduleRequest(blocks=selector(NS, tokens=tokens(1)))]
            )
            assert again.code == ok and stream.opened == 2
            sigstop(c.pid)
            try:
                code, msg = rpc_error(
                    lambda: stream.schedule_batch(
                        [pb.ScheduleRequest(blocks=selector(NS, tokens=tokens(1)))]
                    )
                )
            finally:
                os.kill(c.pid, signal.SIGCONT)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "within 3 s" in msg
            (after,) = stream.schedule_batch(
                [pb.ScheduleRequest(blocks=selector(NS, tokens=tokens(1)))]
            )
            assert after.code == ok and stream.opened == 3
    guarded = start_conductor("--token", "admin-secret", "--tenant-token", "t1=alice")
    with ConductorClient(guarded.address, token="nobody", timeout_s=3) as stranger:
        with stranger.schedule_stream() as stream:
            code, _ = rpc_error(
                lambda: stream.schedule_batch(
                    [pb.ScheduleRequest(blocks=selector(NS, tokens=tokens(1)))]
                )
            )
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_streams_past_the_cap_are_refused_and_their_clients_go_unary(start_conductor, start_member):
    """Each open ScheduleStream holds a handler thread: past ``--max-streams`` a stream is
    refused (RESOURCE_EXHAUSTED) and its client's batches go unary, answered all the same; a
    closed stream gives its slot back."""
    c = start_conductor("--workers", "3", "--max-streams", "1")
    start_member(c, "p0", "prefill")
    start_member(c, "d0", "decode")
    one = [pb.ScheduleRequest(blocks=selector(NS, tokens=tokens(1)))]
    ok = grpc.StatusCode.OK.value[0]
    clients = [ConductorClient(c.address, timeout_s=5) for _ in range(3)]
    try:
        wait_until(lambda: node_ids(clients[0]) == {"p0", "d0"}, what="two registrations")
        first, second = clients[0].schedule_stream(), clients[1].schedule_stream()
        assert [o.code for o in first.schedule_batch(one)] == [ok] and first.streaming
        assert [o.code for o in second.schedule_batch(one)] == [ok] and not second.streaming
        assert [o.code for o in second.schedule_batch(one)] == [ok] and second.opened == 1
        code, msg = rpc_error(
            lambda: next(
                pbg.ConductorServiceStub(make_channel(c.address)).ScheduleStream(
                    iter([pb.ScheduleBatchRequest(requests=one)])
                )
            )
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 1 ScheduleStream" in msg
        # Unary calls are served while the stream holds its thread.
        assert clients[2].schedule(NS, tokens=tokens(2)).prefill_node == "p0"
        first.close()

        def streams():  # a new stream each try: a refused one goes unary for a while
            stream = clients[2].schedule_stream()
            assert [o.code for o in stream.schedule_batch(one)] == [ok]
            if stream.streaming:
                return stream
            stream.close()
            return None

        wait_until(streams, what="the closed stream's slot to come back").close()
    finally:
        for cc in clients:
            cc.close()


def test_index_matches_the_node_after_evictions(start_conductor, start_member):
    c = start_conductor()
    n0 = start_member(c, "n0", "both", dram="1MiB")  # 128 pages of 8 KiB
    with ConductorClient(c.address) as cc, KVStoreClient(n0.address) as k0:
        wait_until(lambda: node_ids(cc) == {"n0"}, what="registration")
        a, b = tokens(100), tokens(100, start=1_000_000)
        k0.put(NS, pages(100), tokens=a)
        k0.put(NS, pages(100), tokens=b)  # LRU evicts most of a
        stored = sum(ns.blocks for ns in k0.stats().namespaces)
        assert stored == 128

        def agrees() -> bool:
            node_a, node_b = k0.lookup(NS, tokens=a).hit_blocks, k0.lookup(NS, tokens=b).hit_blocks
            seen = cc.locate(NS, tokens=a).get("n0", 0), cc.locate(NS, tokens=b).get("n0", 0)
            (status,) = cc.list_nodes().nodes
            return seen == (node_a, node_b) and status.indexed_blocks == stored

        wait_until(agrees, what="conductor index to match the node after evictions")
        assert cc.locate(NS, tokens=b) == {"n0": 100}


def test_tenant_scoped_keys_match_only_the_tenants_blocks(start_conductor, start_member):
    c = start_conductor("--token", "adm", "--tenant-token", "ta=alice", "--tenant-token", "tb=bob")
    n0 = start_member(
        c,
        "n0",
        "both",
        "--token",
        "adm",
        "--tenant-token",
        "ta=alice",
        "--tenant-token",
        "tb=bob",
        "--conductor-token",
        "adm",
    )
    prompt = tokens(4)
    with (
        ConductorClient(c.address, "ta") as alice,
        ConductorClient(c.address, "tb") as bob,
        KVStoreClient(n0.address, "ta") as k_alice,
    ):
        wait_until(lambda: node_ids(alice) == {"n0"}, what="registration with auth")
        assert k_alice.put(NS, pages(4), tokens=prompt).stored == 4
        wait_until(lambda: alice.locate(NS, tokens=prompt) == {"n0": 4}, what="alice's blocks")
        assert bob.locate(NS, tokens=prompt) == {}
        assert bob.schedule(NS, tokens=prompt).reuse_blocks == 0
        assert alice.schedule(NS, tokens=prompt, request_id="same").reuse_blocks == 4
        bob.schedule(NS, tokens=prompt, request_id="same")  # request ids are per tenant too
        raw = block_keys(prompt, BT, root_key(NS))
        assert alice.locate(NS, keys=raw) == {"n0": 4}
        with ConductorClient(c.address, "adm") as admin:  # admin names the stored (scoped) keys
            assert admin.locate(NS, keys=scope_keys(raw, "alice")) == {"n0": 4}


@pytest.mark.slow
def test_lease_expiry_and_reregistration_after_conductor_restart(start_kvcache, start_member):
    c = start_kvcache("conductor", "--listen", "127.0.0.1:0", "--lease", "1")
    port = c.address.rsplit(":", 1)[1]
    n0 = start_member(c, "n0", "prefill")
    n1 = start_member(c, "n1", "both")
    prompt = tokens(5)
    with KVStoreClient(n0.address) as k0:
        k0.put(NS, pages(5), tokens=prompt)
    with KVStoreClient(n1.address) as k1:
        k1.put(NS, pages(2), tokens=prompt[: 2 * BT])
    with ConductorClient(c.address) as cc:
        wait_until(lambda: cc.locate(NS, tokens=prompt) == {"n0": 5, "n1": 2}, what="index")
        n0.kill()  # no unregister: only the lapsed lease tells
        wait_until(lambda: node_ids(cc) == {"n1"}, timeout_s=10, what="n0's lease to lapse")
        assert cc.locate(NS, tokens=prompt) == {"n1": 2}
        r = cc.schedule(NS, tokens=prompt)
        assert r.prefill_node == "n1" and r.reuse_blocks == 2
    # A restarted conductor knows nothing; the node's agent registers again on NOT_FOUND and
    # its index entries are rebuilt from the snapshot its event stream starts with.
    c.stop()
    c2 = start_kvcache("conductor", "--listen", f"127.0.0.1:{port}", "--lease", "1")
    with ConductorClient(c2.address) as cc:
        wait_until(lambda: node_ids(cc) == {"n1"}, timeout_s=15, what="re-registration")
        wait_until(
            lambda: cc.locate(NS, tokens=prompt) == {"n1": 2},
            timeout_s=15,
            what="re-registration and snapshot rebuild",
        )
        (status,) = cc.list_nodes().nodes
        assert status.node.node_id == "n1" and status.indexed_blocks == 2


# ---- gap detection and resync -------------------------------------------------------------------


class _FaultyNode(npbg.NodeServiceServicer):
    """Fault injection on the event feed (a real node only loses events under overload, which a
    test cannot provoke cheaply). First stream: snapshot {k0}, then seq 1 (k1), then either seq 3
    (``gap``: seq 2 lost) or a seq 2 stored event without a tier (``malformed``). Later streams
    (the conductor's resync): snapshot {k0, k1, k2, k3} at seq 3 in two batches, then seq 4
    evicting k3. Each stream then stays open until the conductor cancels it."""

    def __init__(self, keys: list[bytes], fault: str) -> None:
        self.keys = keys
        self.fault = fault
        self.requests: list[tuple[int, bool]] = []
        self.cond = threading.Condition()

    def Events(self, request, context):
        with self.cond:
            self.requests.append((request.after_seq, request.resync))
            first = len(self.requests) == 1
            self.cond.notify_all()

        def stored(seq: int, key: bytes) -> cpb.BlockEvent:
            return cpb.BlockEvent(seq=seq, kind=cpb.EVENT_STORED, key=key, tier=cpb.TIER_DRAM)

        if first:
            yield npb.EventBatch(
                events=[stored(0, self.keys[0])], snapshot=True, snapshot_done=True, snapshot_seq=0
            )
            yield npb.EventBatch(events=[stored(1, self.keys[1])])
            if self.fault == "gap":
                yield npb.EventBatch(events=[stored(3, self.keys[3])])  # seq 2 never comes
            else:
                yield npb.EventBatch(
                    events=[cpb.BlockEvent(seq=2, kind=cpb.EVENT_STORED, key=self.keys[2])]
                )
        else:
            yield npb.EventBatch(
                events=[stored(3, k) for k in self.keys[:2]], snapshot=True, snapshot_seq=3
            )
            yield npb.EventBatch(
                events=[stored(3, k) for k in self.keys[2:]],
                snapshot=True,
                snapshot_done=True,
                snapshot_seq=3,
            )
            yield npb.EventBatch(
                events=[
                    cpb.BlockEvent(
                        seq=4, kind=cpb.EVENT_EVICTED, key=self.keys[3], tier=cpb.TIER_DRAM
                    )
                ]
            )
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(30)


@pytest.mark.parametrize("fault", ["gap", "malformed"])
def test_feed_faults_trigger_a_resync_from_snapshot(start_conductor, fault):
    c = start_conductor()
    keys = block_keys(tokens(4), BT, root_key(NS))
    node = _FaultyNode(keys, fault)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    npbg.add_NodeServiceServicer_to_server(node, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        stub = pbg.ConductorServiceStub(make_channel(c.address))
        layout = cpb.Layout(
            model="test", num_layers=2, kv_heads=2, head_dim=32, dtype="float16", block_tokens=BT
        )
        reg = stub.RegisterNode(
            pb.RegisterNodeRequest(
                node=pb.NodeDescriptor(
                    node_id="gappy",
                    role=pb.NODE_ROLE_BOTH,
                    address=f"127.0.0.1:{port}",
                    layouts=[layout],
                )
            ),
            timeout=5,
        )
        with node.cond:
            assert node.cond.wait_for(lambda: len(node.requests) >= 2, timeout=15)
        assert node.requests[0] == (0, True)  # a new registration starts with a snapshot
        assert node.requests[1][1] is True  # the fault made the conductor ask for one again
        with ConductorClient(c.address) as cc:
            # After the resync: k0..k3 from the snapshot, then seq 4 evicted k3.
            wait_until(lambda: cc.locate(NS, keys=keys) == {"gappy": 3}, what="resynced index")
            (status,) = cc.list_nodes().nodes
            assert (status.last_seq, status.indexed_blocks, status.resyncing) == (4, 3, False)
        stub.Heartbeat(pb.HeartbeatRequest(node_id="gappy", generation=reg.generation), timeout=5)
    finally:
        server.stop(0)


def test_transfer_plan_keys_travel_packed_and_read_either_way():
    keys = [bytes([i]) * 16 for i in range(3)]
    assert transfer_keys(pb.TransferPlan(key_bytes=b"".join(keys))) == keys
    # A conductor that sends them one by one (the field every plan used before key_bytes).
    assert transfer_keys(pb.TransferPlan(keys=keys)) == keys
    assert transfer_keys(pb.TransferPlan()) == []
    with pytest.raises(InvalidArgument, match="16-byte keys back to back"):
        transfer_keys(pb.TransferPlan(key_bytes=b"x" * 17))


# ---- hot-block replication through the messengers -----------------------------------------------


@pytest.mark.slow
def test_plan_moves_blocks_to_the_chosen_node_through_its_messenger(tmp_path):
    """A local cluster (`kvcache up`'s launcher: conductor, nodes, messengers as processes): the
    conductor hands the plan to the destination's messenger, which fetches the pages from the
    holder; the destination's stored events then show it holding the prefix too."""
    from kvcache.cluster import Cluster, ClusterConfig, NodeSpec

    nodes = [
        NodeSpec(id=i, role=r, layout=TEST_LAYOUT, dram="1MiB")
        for i, r in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    ]
    cluster = Cluster(
        ClusterConfig(
            host="127.0.0.1",
            state_dir=str(tmp_path / "cluster"),
            token=None,
            transport="tcp",
            policy="global-cache",
            nodes=nodes,
            conductor_args=["--transfer-hook", "messenger"],
        )
    )
    state = cluster.start()
    try:
        addr = {n["id"]: n["address"] for n in state["nodes"]}
        prompt, other = tokens(12), tokens(64, start=500_000)
        data = [
            np.random.default_rng(i).integers(0, 256, TEST_PAGE_BYTES, dtype=np.uint8)
            for i in range(12)
        ]
        with (
            ConductorClient(state["conductor"]["address"]) as cc,
            KVStoreClient(addr["p0"]) as k0,
            KVStoreClient(addr["p1"]) as k1,
        ):
            wait_until(lambda: node_ids(cc) == {"p0", "p1", "d0"}, what="registrations")
            k0.put(NS, data, tokens=prompt)
            k0.put(NS, pages(32), tokens=other[: 32 * BT])
            wait_until(lambda: cc.locate(NS, tokens=other).get("p0") == 32, what="p0 indexed")
            assert cc.schedule(NS, tokens=other, request_id="busy").prefill_node == "p0"
            r = cc.schedule(NS, tokens=prompt, request_id="moved")
            assert r.prefill_node == "p1" and r.transfers[0].dst_messenger
            wait_until(
                lambda: cc.locate(NS, tokens=prompt) == {"p0": 12, "p1": 12},
                timeout_s=30,
                what="p1 to hold the replicated prefix",
            )
            copies = k1.get(NS, tokens=prompt)
            assert all(np.array_equal(a, b) for a, b in zip(copies, data))
    finally:
        cluster.stop()


def test_a_node_stopping_cleanly_leaves_at_once(start_conductor, start_member):
    c = start_conductor("--lease", "60")  # a lapsed lease cannot explain what follows
    n0 = start_member(c, "n0", "both")
    with ConductorClient(c.address) as cc:
        wait_until(lambda: node_ids(cc) == {"n0"}, what="registration")
        assert n0.stop() == 0
        wait_until(lambda: node_ids(cc) == set(), timeout_s=10, what="unregistration")
        code, msg = rpc_error(lambda: cc.schedule(NS, tokens=tokens(2)))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "no registered node" in msg
