"""What the cache did for a request, through ``kvcache router``: whether a prompt was cached tells
a caller whether someone sent it before, so others' prompts can be recovered block by block (the
class of vLLM's CVE-2025-46570). The x-kvcache-* headers, the usage's cached tokens and the
conductor's estimates are the operator's to see, off by default. A real router, conductor and
nodes; vLLM-like engines from test_router_engines.py; requests as an API client sends them."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from test_router_engines import MODEL, PREFILL_CACHED, PROMPT, FakeEngines

from clients.conductor_client import ConductorClient
from plumbing.launch import start_service

from conftest import TEST_LAYOUT
from helpers import wait_until

NODES = {"prefill-0": "prefill", "decode-0": "decode"}
USER_KEY, ADMIN_KEY = "user-key", "operator-key"


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    """(router without --debug-headers, router with it and an operator key), both asking for
    the API key, in front of one conductor, two nodes and their fake engines."""
    tmp = tmp_path_factory.mktemp("side-channels")
    (tmp / "user").write_text(USER_KEY + "\n")
    (tmp / "admin").write_text(ADMIN_KEY + "\n")
    engines = FakeEngines(list(NODES))
    started = []
    try:
        conductor = start_service(["conductor", "--listen", "127.0.0.1:0"], log_dir=str(tmp))
        started.append(conductor)
        for node, role in NODES.items():
            started.append(
                start_service(
                    [
                        "node",
                        "--listen",
                        "127.0.0.1:0",
                        "--dram",
                        "1MiB",
                        "--layout",
                        TEST_LAYOUT,
                        "--conductor",
                        conductor.address,
                        "--node-id",
                        node,
                        "--role",
                        role,
                    ],
                    log_dir=str(tmp),
                )  # fmt: skip
            )
        with ConductorClient(conductor.address) as c:
            wait_until(lambda: len(c.list_nodes().nodes) == len(NODES), 30, "nodes to register")
        base = ["router", "--listen", "127.0.0.1:0", "--conductor", conductor.address]
        base += [a for node, url in engines.urls.items() for a in ("--engine", f"{node}={url}")]
        base += ["--api-key-file", str(tmp / "user")]
        plain = start_service(base, log_dir=str(tmp))
        started.append(plain)
        debug = start_service(
            [*base, "--debug-headers", "--admin-key-file", str(tmp / "admin")], log_dir=str(tmp)
        )
        started.append(debug)
        yield plain, debug
    finally:
        for sp in reversed(started):
            sp.stop()
        engines.close()


def complete(router, key: str, **extra) -> tuple[int, dict[str, str], dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **extra}
    request = urllib.request.Request(
        f"http://{router.address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def cache_headers(headers: dict[str, str]) -> set[str]:
    return {k for k in headers if k.startswith("x-kvcache-")}


def test_api_clients_never_learn_what_the_cache_did(routers):
    plain, debug = routers
    for router in (plain, debug):
        status, headers, body = complete(router, USER_KEY)
        assert status == 200
        assert headers["x-request-id"]  # an id to quote, nothing else
        assert cache_headers(headers) == set()  # before: reuse blocks, cached tokens, ...
        assert "prompt_tokens_details" not in body["usage"]
        assert body["usage"]["prompt_tokens"] == len(PROMPT)


def test_the_operator_sees_it_only_where_it_is_turned_on(routers):
    plain, debug = routers
    status, headers, body = complete(debug, ADMIN_KEY)
    assert status == 200
    assert {"x-kvcache-reuse-blocks", "x-kvcache-prefill-cached-tokens",
            "x-kvcache-held-pages"} <= cache_headers(headers)  # fmt: skip
    # what the prefill found cached (the fake prefill's count)
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": PREFILL_CACHED}
    # The operator's key is not an API key where it was not given.
    assert complete(plain, ADMIN_KEY)[0] == 401


def test_an_slo_refusal_names_the_slo_not_the_estimate(routers):
    plain, _ = routers
    status, _, body = complete(plain, USER_KEY, ttft_slo_s=1e-6)
    assert status == 429
    message = body["error"]["message"]
    assert "TTFT SLO" in message
    # Before: "best estimate 12.3 ms (... prefill ... of 40 uncached tokens)".
    assert "estimate" not in message and "uncached" not in message


def test_debug_headers_with_an_api_key_need_an_operator_key(tmp_path):
    (tmp_path / "user").write_text(USER_KEY + "\n")
    with pytest.raises(RuntimeError, match="--debug-headers needs --admin-key-file"):
        start_service(
            ["router", "--listen", "127.0.0.1:0", "--conductor", "127.0.0.1:1",
             "--engine", "n=http://127.0.0.1:1", "--api-key-file", str(tmp_path / "user"),
             "--debug-headers"],
            log_dir=str(tmp_path),
        )  # fmt: skip
