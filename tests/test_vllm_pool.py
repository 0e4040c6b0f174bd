"""One pool for every engine, with real vLLM engines (CPU, tiny model) on two real nodes, their
messengers and a conductor: a prefix one engine stored on its node is found by an engine on the
other node through the conductor's index, pulled into that engine's node while the request
waits (vLLM's WAITING_FOR_REMOTE_KVS), and loaded from there."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import numpy as np
import pytest
from test_vllm_connector_cases import BT, LAYOUT_FLAG, MODEL, PROMPT, tokens

from bench.engines.models import MODELS, make_model
from bench.micro.pool_ttft import start_pool
from clients import KVStoreClient
from clients.conductor_client import ConductorClient
from clients.messenger_client import MessengerClient
from clients.vllm_identity import rank_keys
from kvstore.keys import block_keys, root_key
from plumbing.launch import ServiceProcess, free_port, start_service
from rpc.tls import make_local_ca

from helpers import sigstop, wait_until
from vllm_driver import Engine

pytest.importorskip("vllm")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-pool")


@pytest.fixture(scope="module")
def model(work) -> str:
    path = str(work / MODEL)
    make_model(path, MODELS["tiny"], max_len=1024)
    return path


ADMIN, SERVICE, DATA, ALICE, MALLORY = "admin-t", "service-t", "data-t", "alice-t", "mallory-t"


@dataclass
class Secured:
    """The pool's processes and what a tenant's engine needs to reach them."""

    conductor: ServiceProcess
    nodes: dict[str, ServiceProcess]
    ca: str  # the cluster's CA (every link speaks TLS)
    files: dict[str, str]  # token files: admin, service, data, alice, mallory, tenants

    def engine(self, node: str, tenant: str = "alice", pool: bool = True) -> dict:
        """A connector config for an engine of ``tenant`` on ``node`` (``pool``: with the
        conductor)."""
        config = {
            "node": self.nodes[node].address,
            "token_file": self.files[tenant],
            "tls_ca_file": self.ca,
        }
        if pool:
            config["conductor"] = self.conductor.address
        return config


@pytest.fixture(scope="module")
def cluster(work):
    """A conductor and two nodes (A, B), each with its messenger, registered, as ``kvcache up
    --tls`` with tenants runs them: TLS on every link, an admin token, the conductor's service
    token, the messengers' data token, and two tenants (alice, mallory) for the engines."""
    procs = []

    def start(*args: str):
        sp = start_service(list(args), log_dir=str(work))
        procs.append(sp)
        return sp

    files = {}
    for name, text in (
        ("admin", ADMIN), ("service", SERVICE), ("data", DATA), ("alice", ALICE),
        ("mallory", MALLORY), ("tenants", f"{ALICE}=alice\n{MALLORY}=mallory"),
    ):  # fmt: skip
        files[name] = str(work / f"{name}-token")
        (work / f"{name}-token").write_text(text + "\n")
        os.chmod(files[name], 0o600)
    tls = make_local_ca(str(work / "tls"), ["127.0.0.1"])
    serve_tls = ["--tls-cert", tls.cert, "--tls-key", tls.key]
    common = ["--token-file", files["admin"], "--tenant-tokens-file", files["tenants"]]
    try:
        conductor = start(
            "conductor", "--listen", "127.0.0.1:0", *common, *serve_tls,
            "--node-token-file", files["service"], "--node-tls-ca", tls.ca_cert,
        )  # fmt: skip
        nodes = {}
        for node_id in ("A", "B"):
            messenger_at = f"127.0.0.1:{free_port('127.0.0.1')}"
            nodes[node_id] = start(
                "node", "--listen", "127.0.0.1:0", "--dram", "32MiB", "--layout", LAYOUT_FLAG,
                "--node-id", node_id, "--messenger", messenger_at, "--conductor",
                conductor.address, "--conductor-token-file", files["admin"],
                "--conductor-tls-ca", tls.ca_cert, "--service-token-file", files["service"],
                *common, *serve_tls,
            )  # fmt: skip
            start(
                "messenger", "--node", nodes[node_id].address, "--listen", messenger_at,
                "--node-tls-ca", tls.ca_cert, "--service-token-file", files["service"],
                "--data-token-file", files["data"], *common, *serve_tls,
            )  # fmt: skip
        with ConductorClient(conductor.address, ADMIN, tls.ca_cert) as c:
            wait_until(lambda: len(c.list_nodes().nodes) == 2, 30, "the nodes to register")
        yield Secured(conductor, nodes, tls.ca_cert, files)
    finally:
        for sp in reversed(procs):
            sp.stop()


def held(cluster: Secured, node: str, kvcache: dict, prompt: list[int], who: str = ALICE) -> int:
    """Leading pages of ``prompt`` that ``node`` holds for tenant ``who``."""
    root = root_key(kvcache["namespace"], bytes.fromhex(kvcache["salt"]))
    with KVStoreClient(cluster.nodes[node].address, who, cluster.ca) as c:
        return c.lookup(kvcache["namespace"], keys=block_keys(prompt, BT, root)).hit_blocks


def stored(cluster: Secured, node: str, kvcache: dict, prompt: list[int], who: str = ALICE) -> int:
    """``held`` once the engine's commits landed: a worker sends its step's Commit and goes on
    (the answer is collected at a later step), so a request's answer can reach the test
    before its pages are on the node."""
    pages = (len(prompt) - 1) // BT
    wait_until(lambda: held(cluster, node, kvcache, prompt, who) >= pages, 60, f"{node}'s commit")
    return held(cluster, node, kvcache, prompt, who)


def flood(cluster: Secured, node: str, nbytes: int) -> None:
    """The admin's writer (no tenant's share to keep it in check) stores ``nbytes`` of pages on
    ``node``, evicting whatever is not pinned."""
    with KVStoreClient(cluster.nodes[node].address, ADMIN, cluster.ca) as c:
        (ns,) = c.namespaces()
        page = c.namespace_info(ns).page_bytes
        rng = np.random.default_rng(3)
        for _ in range(nbytes // page // 64):
            keys = [rng.bytes(16) for _ in range(64)]
            c.put(ns, [np.zeros(page, np.uint8)] * 64, keys=keys)


def test_an_engine_loads_a_prefix_another_node_holds_and_keeps_it_on_its_own(model, cluster, work):
    """Before, an engine saw only its own node: B's engine recomputed what A's had stored.
    Every link speaks TLS and the engines run as tenants: alice's engine on B pulls what
    alice's engine on A stored; mallory's engine on B finds none of it. B's engine is told a
    pull must cost next to nothing against computing (``pull_max_cost``): its first pull is
    made (nothing measured yet), the next is not (its tokens are computed)."""
    later = tokens(83, 4 * BT + 10)
    with Engine(model, cluster.engine("A", pool=False), log_path=str(work / "a.log")) as e:
        first, first_later = e.generate([PROMPT, later])
    keys = first["kvcache"]
    assert held(cluster, "A", keys, PROMPT) == 4
    root = root_key(keys["namespace"], bytes.fromhex(keys["salt"]))
    with ConductorClient(cluster.conductor.address, ALICE, cluster.ca) as c:
        for prompt in (PROMPT, later):
            wait_until(
                lambda p=prompt: (
                    c.locate(keys["namespace"], keys=block_keys(p, BT, root)).get("A") == 4
                ),
                30,
                "the conductor to index A's pages",
            )
    engine_b = {**cluster.engine("B"), "pull_max_cost": 1e-9}
    with Engine(model, engine_b, log_path=str(work / "b.log")) as e:
        (pulled,) = e.generate([PROMPT])
        stats = e.stats()
        assert pulled["tokens"] == first["tokens"]
        assert stats["remote_pulls"] == 1 and stats["remote_failed"] == 0
        assert stats["loaded_pages"] == 4 and stats["load_failed_blocks"] == 0
        assert stats["remote_loads"] == 1  # its Lookup-to-load seconds, for the histogram
        assert stored(cluster, "B", keys, PROMPT) == 4  # on B now: the next request hits there
        (again,) = e.generate([PROMPT])
        assert again["cached"] == 4 * BT and again["tokens"] == first["tokens"]
        assert e.stats()["remote_pulls"] == 1  # B's own hit, no second pull
        # A prompt nobody holds: no pull, computed in full.
        (fresh,) = e.generate([tokens(77, 3 * BT + 5)])
        assert fresh["cached"] == 0 and e.stats()["remote_pulls"] == 1
        # The gate has measured a pull and the engine's steps: computing is cheaper than
        # 1e-9 of a pull's wait, so A's pages of the next prompt are not pulled.
        skipped = e.stats()["remote_skipped"]
        (computed,) = e.generate([later])
        stats = e.stats()
        assert stats["remote_skipped"] == skipped + 1 and stats["remote_pulls"] == 1
        assert computed["tokens"] == first_later["tokens"]
        assert stored(cluster, "B", keys, later) == 4  # computed and stored on B
    # Another tenant's engine on the same node: alice's pages are neither found nor pulled.
    with Engine(model, cluster.engine("B", "mallory"), log_path=str(work / "m.log")) as e:
        (other,) = e.generate([PROMPT])
        stats = e.stats()
    assert other["cached"] == 0 and other["tokens"] == first["tokens"]
    assert stats["remote_pulls"] == 0 and stats["loaded_pages"] == 0
    assert stored(cluster, "B", keys, PROMPT, MALLORY) == 4  # mallory's own, computed
    assert held(cluster, "A", keys, PROMPT, MALLORY) == 0


def test_a_tensor_parallel_engine_stores_a_share_per_rank_and_pulls_every_ranks_share(model, work):
    """TP=2 (a multi-process engine, one core per rank) on node E of a pool: each rank stores
    its KV head under keys of its own in the same namespace; once only node F holds the prompt,
    both ranks' shares are pulled in one batch (found by rank 0's keys) and each rank loads its
    own. Before, a multi-rank engine never pulled: it recomputed what another node held."""
    prompt = tokens(81, 4 * BT + 10)
    procs: list[ServiceProcess] = []

    def start(*args: str) -> ServiceProcess:
        sp = start_service(list(args), log_dir=str(work))
        procs.append(sp)
        return sp

    try:
        # Both nodes serve a rank's layout (one KV head of two) from their start.
        rank_layout = LAYOUT_FLAG.replace("kv_heads=2", "kv_heads=1")
        conductor, nodes, messengers = start_pool(start, rank_layout, ("E", "F"), "32MiB")
        config = {"node": nodes["E"].address, "conductor": conductor.address, "block_tokens": BT}
        with Engine(
            model,
            config,
            engine={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
            env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
            log_path=str(work / "tp2.log"),
        ) as e:
            (full,) = e.generate([prompt])
            kv = full["kvcache"]
            ns = kv["namespace"]
            assert ns.startswith(f"{MODEL}|L2|H1|D32|bfloat16|")
            assert sorted(kv["ranks"]) == ["tp0/2|pp0/1", "tp1/2|pp0/1"]
            chain = block_keys(prompt, BT, root_key(ns, bytes.fromhex(kv["salt"])))
            ranked = [rank_keys(chain, tag) for tag in sorted(kv["ranks"])]
            # The pages move to F and E forgets them: only F holds the prompt now.
            with KVStoreClient(nodes["E"].address) as on_e, KVStoreClient(nodes["F"].address) as f:
                assert on_e.lookup(ns, keys=chain).hit_blocks == 0  # no rank's own keys
                for keys in ranked:  # each rank's Commit is answered after its step ended
                    wait_until(lambda k=keys: on_e.lookup(ns, keys=k).hit_blocks == 4, 60, "E")
                    f.put(ns, on_e.get(ns, keys=keys), keys=keys)
                    assert on_e.remove(ns, keys=keys) == 4
            with ConductorClient(conductor.address) as c:
                wait_until(lambda: c.locate(ns, keys=ranked[0]).get("F") == 4, 30, "F indexed")
            (pulled,) = e.generate([prompt])
            # the stats of a multi-process engine reach vLLM's metrics with a later step's
            e.generate([tokens(82, 8)], max_tokens=2)
            metrics = e.metrics()
        assert pulled["tokens"] == full["tokens"]
        with MessengerClient(messengers["E"].address) as m:
            pulled_entries = m.stats().entries_done
        assert metrics["vllm:kvcache_remote_pulls"] == 1, (metrics, pulled_entries)
        assert metrics["vllm:kvcache_remote_failed"] == 0
        assert metrics["vllm:kvcache_remote_load_seconds_count"] == 1  # Lookup to load
        assert metrics["vllm:kvcache_loaded_pages"] == 8  # 4 pages, a share of each per rank
        assert metrics["vllm:kvcache_load_failed_blocks"] == 0
        with MessengerClient(messengers["E"].address) as m:
            assert m.stats().entries_done == 8  # both ranks' shares pulled into E
        with KVStoreClient(nodes["E"].address) as on_e:
            for keys in ranked:  # both shares on E now: the next request there hits locally
                assert on_e.lookup(ns, keys=keys).hit_blocks == 4
    finally:
        for sp in reversed(procs):
            sp.stop()


def test_a_pool_whose_conductor_is_gone_costs_a_miss(model, cluster, work):
    """A conductor that does not answer: the engine serves from its own node only."""
    gone = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    pool = {**cluster.engine("B"), "conductor": gone, "remote_timeout_ms": 200}
    prompt = tokens(78, 4 * BT + 10)
    with Engine(model, pool, log_path=str(work / "gone.log")) as e:
        (out,) = e.generate([prompt])
        assert out["cached"] == 0 and e.stats()["remote_pulls"] == 0


def test_a_pull_that_does_not_arrive_in_time_is_recomputed_never_waited_for(model, work):
    """The source's messenger hangs (SIGSTOP) once the conductor indexed its node's pages: the
    request waits ``pull_timeout_s``, the pull is cancelled, its blocks are load errors, and
    vLLM computes them: the same tokens as the engine that computed the prompt, no hang."""
    procs = []

    def start(*args: str):
        sp = start_service(list(args), log_dir=str(work))
        procs.append(sp)
        return sp

    messengers = {}
    try:
        conductor, nodes, messengers = start_pool(start, LAYOUT_FLAG, ("C", "D"), "32MiB")
        with Engine(model, {"node": nodes["C"].address}, log_path=str(work / "c.log")) as e:
            (first,) = e.generate([PROMPT])
        keys = first["kvcache"]
        root = root_key(keys["namespace"], bytes.fromhex(keys["salt"]))
        with ConductorClient(conductor.address) as c:
            chain = block_keys(PROMPT, BT, root)
            wait_until(
                lambda: c.locate(keys["namespace"], keys=chain).get("C") == 4, 30, "the index"
            )
        sigstop(messengers["C"].pid)
        pool = {"node": nodes["D"].address, "conductor": conductor.address, "pull_timeout_s": 1}
        with Engine(model, pool, log_path=str(work / "d.log")) as e:
            (out,) = e.generate([PROMPT])
            stats = e.stats()
        assert out["tokens"] == first["tokens"]
        assert stats["remote_pulls"] == 1 and stats["remote_failed"] == 1
        assert stats["load_failed_blocks"] > 0
    finally:
        if "C" in messengers:
            os.kill(messengers["C"].pid, signal.SIGCONT)
        for sp in reversed(procs):
            sp.stop()


def test_vllms_own_prefill_decode_flow_moves_the_prompt_through_the_messengers(
    model, cluster, work
):
    """As vLLM's disaggregated proxy (and llm-d's sidecar) drive a P/D connector: the prefill
    request carries ``do_remote_decode`` and one output token; its answer's kv_transfer_params
    (``do_remote_prefill``, the prefill node's messenger, the pages it stored) go with the
    decode request, whose engine pulls those pages into its own node and loads them. No
    conductor, no kvcache router."""
    prompt = tokens(79, 4 * BT + 20)
    ask = {"do_remote_decode": True, "kvcache_keys": True}
    with Engine(model, cluster.engine("A", pool=False), log_path=str(work / "p.log")) as p:
        (prefilled,) = p.generate([{"tokens": prompt, "kv_transfer_params": ask}], max_tokens=1)
        assert prefilled["cached"] == 0  # computed here, and stored on its node
        params = dict(prefilled["kv_transfer_params"])
        kvcache = params.pop("kvcache")
        assert params["do_remote_prefill"] is True and params["kvcache_pages"] == 4
        assert params["kvcache_messenger"]  # the node's own (it was started with --messenger)
        # Until the decode side pulls them, the prefill engine holds the pages pinned: writers
        # that fill A's pool twice over meanwhile evict everything else.
        wait_until(lambda: p.stats()["decode_holds"] == 1, 30, "the prefill to pin its pages")
        flood(cluster, "A", 2 * 32 << 20)
        assert held(cluster, "A", kvcache, prompt) == 4
        with Engine(model, None, log_path=str(work / "full.log")) as plain:
            (full,) = plain.generate([prompt], max_tokens=8)  # what a full computation decodes
        with Engine(model, cluster.engine("B", pool=False), log_path=str(work / "pd.log")) as d:
            (decoded,) = d.generate(
                [{"tokens": prompt, "kv_transfer_params": params}], max_tokens=8
            )
            stats = d.stats()
    # NOTE: vLLM's num_cached_tokens of a request loaded asynchronously can read 0 (it is set
    # at its first admission); the connector's counters say what was loaded.
    assert decoded["tokens"] == full["tokens"]
    assert stats["remote_pulls"] == 1 and stats["remote_failed"] == 0
    assert stats["loaded_pages"] == 4 and stats["load_failed_blocks"] == 0
