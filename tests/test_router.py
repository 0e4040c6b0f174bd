"""``kvcache router`` as a real process, without engines behind it: what a client gets for bad
requests, an unreachable engine or a missing API key (clear HTTP errors, fast, never a hang),
and its command-line mistakes. Serving with real vLLM engines is test_serving.py."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from plumbing.launch import start_service
from router.engines import _dumps


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def routers(tmp_path_factory):
    """A conductor and two routers (one with an API key) whose engine is a closed port."""
    logs = str(tmp_path_factory.mktemp("router"))
    engine = f"http://127.0.0.1:{_closed_port()}"
    started = [start_service(["conductor", "--listen", "127.0.0.1:0"], log_dir=logs)]
    try:
        for extra in ([], ["--api-key", "sesame"]):
            args = ["router", "--listen", "127.0.0.1:0", "--conductor", started[0].address]
            args += ["--engine", f"prefill-0={engine}", "--engine-timeout", "5", *extra]
            started.append(start_service(args, log_dir=logs))
        yield started[1].address, started[2].address
    finally:
        for sp in reversed(started):
            sp.stop()


def _call(address: str, path: str, body: object = None, headers: dict | None = None):
    data = (
        None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    )
    request = urllib.request.Request(
        f"http://{address}{path}", data=data, headers={"content-type": "application/json"}
    )
    for k, v in (headers or {}).items():
        request.add_header(k, v)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "not JSON"),
        ([1, 2], "JSON object"),
        ({"prompt": "hi"}, "'model' is required"),
        ({"model": "m"}, "'prompt' is required"),
        ({"model": "m", "prompt": ""}, "empty"),
        ({"model": "m", "prompt": ["a", "b"]}, "one prompt per request"),
        ({"model": "m", "prompt": [1, 2**32]}, "token ids"),
        ({"model": "m", "prompt": [1, True]}, "token ids"),
        ({"model": "m", "prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"model": "m", "prompt": "hi", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "hi", "tbt_slo_s": "fast"}, "tbt_slo_s"),
    ],
)
def test_malformed_requests_are_400_naming_what_to_fix(routers, body, says):
    status, text = _call(routers[0], "/v1/completions", body)
    assert status == 400
    error = json.loads(text)["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"


def test_engines_that_do_not_answer_are_a_fast_503_not_a_hang(routers):
    address = routers[0]
    assert _call(address, "/health")[0] == 200
    status, text = _call(address, "/v1/models")
    assert status == 503 and "no engine answers /v1/models" in text and "prefill-0" in text
    status, text = _call(address, "/v1/completions", {"model": "m", "prompt": [1, 2, 3]})
    assert status == 503 and "prefill-0" in json.loads(text)["error"]["message"]
    status, text = _call(address, "/metrics")
    assert 'kvcache_router_requests_total{outcome="unavailable"} 1.0' in text


def test_unknown_paths_wrong_methods_and_oversized_bodies_get_a_clear_error(routers):
    address = routers[0]
    status, text = _call(address, "/v1/embeddings", {"model": "m"})
    error = json.loads(text)["error"]
    assert (
        status == 404
        and "/v1/embeddings" in error["message"]
        and "/v1/completions" in (error["message"])
    )
    status, text = _call(address, "/v1/completions")  # a GET
    assert status == 405 and "POST" in json.loads(text)["error"]["message"]
    status, text = _call(address, "/v1/completions", b"[" + b"1," * (33 << 20) + b"1]")
    assert status == 413 and "shorter prompt" in json.loads(text)["error"]["message"]
    assert _call(address, "/health")[0] == 200  # and it serves on


@pytest.mark.parametrize(
    "body",
    [
        {"model": "m", "prompt": [1, 2, 3], "stream": True, "temperature": 0.5},
        {"model": "m", "prompt": "d\u00e9j\u00e0 vu", "stop": None, "seed": 2**63},
        {"model": "m", "prompt": [1], "logit_bias": {"5": float("nan")}, "x": -float("inf")},
        {"model": "m", "prompt": [1], "seed": 2**70},
    ],
)
def test_what_the_router_sends_an_engine_means_what_the_client_sent(body):
    import math

    sent = json.loads(_dumps(body))
    assert sent.keys() == body.keys()
    for key, value in body.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(sent[key])
        elif key == "logit_bias":
            assert math.isnan(sent[key]["5"])
        else:
            assert sent[key] == value and type(sent[key]) is type(value)


def test_an_api_key_is_required_when_set(routers):
    address = routers[1]
    status, text = _call(address, "/v1/models")
    assert status == 401 and "API key" in json.loads(text)["error"]["message"]
    wrong = {"authorization": "Bearer open"}
    assert _call(address, "/v1/completions", {"model": "m"}, wrong)[0] == 401
    right = {"authorization": "Bearer sesame"}
    assert _call(address, "/v1/models", headers=right)[0] == 503  # past the key: no engines
    assert _call(address, "/health")[0] == 200  # probes need no key


@pytest.mark.parametrize(
    "args, says",
    [
        ([], "--conductor"),
        (["--conductor", "127.0.0.1:1", "--engine", "p0=h:1"], "NODE_ID=http"),
        (
            ["--conductor", "127.0.0.1:1", "--engine", "p0=http://a", "--listen", "8000"],
            "HOST:PORT",
        ),
        (["--cluster", "/nonexistent/cluster.json"], "cannot read --cluster"),
    ],
)
def test_command_line_mistakes_say_what_to_fix(args, says):
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "router", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert says in proc.stderr and "Traceback" not in proc.stderr
