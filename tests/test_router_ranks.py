"""A disaggregated request's decode pull moves what the prefill engine's connector reported:
the prompt's keys under the salt it named, and for an engine of several ranks (tensor or
pipeline parallel, each rank storing its share under keys of its own) every rank's keys. Real
conductor, nodes, messengers and router; the fake engines of test_router_engines.py, whose
prefill stores pages on its node as the connector would and reports their keys."""

from __future__ import annotations

import uuid
import zlib
from typing import Any

import numpy as np
import openai
import pytest
from test_router_engines import MODEL, FakeEngines

from clients.conductor_client import ConductorClient
from clients.node_client import KVStoreClient
from clients.vllm_identity import rank_keys, rank_tag, salt_of
from kvstore.keys import block_keys, root_key
from plumbing.launch import ServiceProcess, free_port, start_service

from conftest import TEST_LAYOUT, TEST_NAMESPACE, TEST_PAGE_BYTES
from helpers import wait_until

BLOCK = 16  # TEST_LAYOUT's block tokens
SALT = bytes(range(16))  # the request's key salt, as a connector reports it
ENGINE = bytes(range(16, 32))  # the engine's salt


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A prefill node ``p`` and a decode node ``d``, each with its messenger and fake engine, a
    conductor, and a disaggregated router in front."""
    logs = str(tmp_path_factory.mktemp("router-ranks"))
    engines = FakeEngines(["p", "d"])
    started: list[ServiceProcess] = []

    def start_kvcache(*args: str) -> ServiceProcess:
        started.append(start_service(list(args), log_dir=logs))
        return started[-1]

    try:
        conductor = start_kvcache("conductor", "--listen", "127.0.0.1:0")
        nodes = {}
        for node_id, role in (("p", "prefill"), ("d", "decode")):
            messenger_at = f"127.0.0.1:{free_port('127.0.0.1')}"
            nodes[node_id] = start_kvcache(
                "node", "--listen", "127.0.0.1:0", "--dram", "1MiB", "--layout", TEST_LAYOUT,
                "--node-id", node_id, "--role", role, "--messenger", messenger_at,
                "--conductor", conductor.address,
            )  # fmt: skip
            start_kvcache("messenger", "--node", nodes[node_id].address, "--listen", messenger_at)
        with ConductorClient(conductor.address) as c:
            wait_until(lambda: len(c.list_nodes().nodes) == 2, 30, "the nodes to register")
        args = ["router", "--listen", "127.0.0.1:0", "--conductor", conductor.address]
        args += ["--debug-headers"]  # no keys: every caller sees what the cache did
        for node, url in engines.urls.items():
            args += ["--engine", f"{node}={url}"]
        router = start_kvcache(*args)
        client = openai.OpenAI(
            base_url=f"http://{router.address}/v1", api_key="unused", max_retries=0, timeout=60
        )
        yield engines, nodes, client, conductor
    finally:
        for sp in reversed(started):
            sp.stop()
        engines.close()


def _stored(node: str, tags: list[str], reported: list[str]):
    """A prefill that stores each rank's pages (bytes of their own) under its keys on ``node``,
    and reports ``reported`` as the engine's ranks; the pages it stored, by key, in ``.pages``."""
    pages: dict[bytes, np.ndarray] = {}

    def store(prompt: list[int]) -> dict[str, Any]:
        chain = block_keys(prompt, BLOCK, root_key(TEST_NAMESPACE, SALT))
        rng = np.random.default_rng(len(pages))
        with KVStoreClient(node) as c:
            for tag in tags:
                keys = rank_keys(chain, tag)
                data = list(rng.integers(0, 256, (len(keys), TEST_PAGE_BYTES), dtype=np.uint8))
                assert c.put(TEST_NAMESPACE, data, keys=keys).stored == len(keys)
                pages.update(zip(keys, data))
        return {
            "namespace": TEST_NAMESPACE,
            "salt": SALT.hex(),
            "engine": ENGINE.hex(),
            "ranks": reported,
        }

    store.pages = pages  # type: ignore[attr-defined]
    return store


@pytest.mark.parametrize(
    "tags",
    [[""], [rank_tag(r, 2, 0, 1) for r in range(2)], [rank_tag(0, 2, p, 2) for p in range(2)]],
    ids=["one-rank", "tp2", "tp2-pp2-stage0"],
)
def test_the_decode_pull_moves_every_ranks_pages_under_the_reported_salt(fleet, tags):
    engines, nodes, client, _ = fleet
    store = _stored(nodes["p"].address, tags, [t for t in tags if t])
    engines.stores["p"] = store
    prompt = [
        int(x)
        for x in np.random.default_rng(zlib.crc32("|".join(tags).encode())).integers(
            3, 500, 4 * BLOCK + 5
        )
    ]
    rid = f"test-{uuid.uuid4().hex[:12]}"
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=3, user="whole", extra_headers={"X-Request-Id": rid}
    )
    assert out.choices[0].finish_reason == "length"
    with engines._lock:
        assert [(n, kind) for n, kind, r, _ in engines.calls if r == rid] == [
            ("p", "prefill"),
            ("d", "decode"),
        ]
    # The decode was sent once its pull ended: the decode node holds every rank's pages whole.
    with KVStoreClient(nodes["d"].address) as c:
        keys = list(store.pages)
        assert len(keys) == 4 * len(tags)
        assert c.lookup(TEST_NAMESPACE, keys=keys).hit_blocks == len(keys)
        for key, page in zip(keys, c.get(TEST_NAMESPACE, keys=keys)):
            assert np.array_equal(np.asarray(page), store.pages[key]), key.hex()
        # and nothing under the unsalted chain's keys
        plain = block_keys(prompt, BLOCK, root_key(TEST_NAMESPACE))
        assert c.lookup(TEST_NAMESPACE, keys=plain).hit_blocks == 0


def test_a_request_with_a_cache_salt_is_scheduled_where_its_salted_pages_are(fleet):
    """The router schedules by the salt the connector gives the request's keys: the engines'
    salt (learned from a prefill's answer) with its ``cache_salt`` mixed in."""
    engines, nodes, client, conductor = fleet
    engines.stores["p"] = _stored(nodes["p"].address, [""], [])  # reports the engines' salt
    client.completions.create(model=MODEL, prompt=[5] * (BLOCK + 1), max_tokens=1, user="whole")
    del engines.stores["p"]  # learned; the prefills below store nothing
    prompt = [int(x) for x in np.random.default_rng(11).integers(3, 500, 4 * BLOCK + 5)]
    salted = salt_of(ENGINE, "alice")
    with KVStoreClient(nodes["p"].address) as c:
        c.put(TEST_NAMESPACE, [bytes(TEST_PAGE_BYTES)] * 4, tokens=prompt, salt=salted)
    with ConductorClient(conductor.address) as c:
        wait_until(
            lambda: c.locate(TEST_NAMESPACE, tokens=prompt, salt=salted).get("p") == 4,
            30,
            "the conductor to index the salted pages",
        )
    for cache_salt, found in (("alice", "4"), ("bob", "0"), (None, "0")):
        extra = {"cache_salt": cache_salt} if cache_salt else {}
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=prompt, max_tokens=1, user="whole", extra_body=extra
        )
        assert raw.headers["x-kvcache-reuse-blocks"] == found, cache_salt
