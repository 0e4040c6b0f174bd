"""``[[engines]]``, ``[engine_defaults]`` and ``[router]`` in a cluster TOML: what they become
(the engine command the launcher runs, the conductor's scrape flags), and the mistakes that
stop ``kvcache up`` with a message naming the key, before anything starts."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvcache.cluster import load_config
from kvcache.cluster_config import ConfigError
from kvcache.engines import Serving, kv_transfer_config, serving_config
from plumbing.launch import PortReservation

NODES = """
[[node]]
id = "p0"
role = "prefill"

[[node]]
id = "d0"
role = "decode"
"""
ENGINES = """
[engine_defaults]
model = "models/tiny"
args = ["--block-size", "32"]

[[engines]]
node = "p0"

[[engines]]
node = "d0"
port = 8200
"""


def _config(tmp_path, text: str) -> str:
    path = tmp_path / "cluster.toml"
    path.write_text(NODES + text)
    return str(path)


def test_engines_get_their_kv_role_by_node_role_and_the_conductor_their_metrics(tmp_path):
    cfg = load_config(_config(tmp_path, ENGINES + '[router]\nlisten = "127.0.0.1:0"\n'))
    serving = serving_config(cfg)
    assert serving is not None
    p0, d0 = serving.engines
    # a relative model directory is relative to the config file, as state_dir is
    assert p0.model == str(tmp_path / "models" / "tiny")
    assert (p0.node, p0.kv_role, p0.served_model_name) == ("p0", "both", "tiny")
    assert (d0.node, d0.kv_role, d0.port, d0.args) == (
        "d0",
        "consumer",
        8200,
        ("--block-size", "32"),
    )
    assert serving.router_listen == "127.0.0.1:0"
    flags = Serving(serving, "127.0.0.1").plan(lambda host: PortReservation(8100, None))
    assert flags == [
        "--engine-metrics",
        "http://127.0.0.1:8100/metrics=p0",
        "--engine-metrics",
        "http://127.0.0.1:8200/metrics=d0",
    ]


def test_an_engine_entry_overrides_the_defaults(tmp_path):
    text = ENGINES.replace(
        "port = 8200", 'kv_role = "both"\nenv = ["VLLM_CPU_OMP_THREADS_BIND=1"]\nargs = []'
    )
    serving = serving_config(load_config(_config(tmp_path, text)))
    assert serving is not None
    d0 = serving.engines[1]
    assert (d0.kv_role, d0.env, d0.args) == ("both", (("VLLM_CPU_OMP_THREADS_BIND", "1"),), ())


def test_pool_gives_an_engines_connector_the_conductor(tmp_path):
    """``pool = true`` (defaults or one entry): the engine loads prefixes cached on any node."""
    text = ENGINES.replace('args = ["--block-size", "32"]', "args = []\npool = true")
    text = text.replace("port = 8200", "pool = false")
    serving = serving_config(load_config(_config(tmp_path, text)))
    assert serving is not None
    node = {"address": "127.0.0.1:7000", "layout": "model=m,num_layers=2,kv_heads=2,head_dim=32"}
    extras = [
        kv_transfer_config(e, node, None, None, "127.0.0.1:9000")["kv_connector_extra_config"]
        for e in serving.engines
    ]
    assert extras[0]["conductor"] == "127.0.0.1:9000" and "conductor" not in extras[1]
    assert extras[0]["node"] == "127.0.0.1:7000" and extras[0]["model"] == "m"


def test_nodes_of_a_cluster_with_engines_serve_what_the_engines_register(tmp_path):
    """With [[engines]] a node has no layout unless one is named (for it, or in [defaults]):
    it starts without --layout and its engine's connector registers the model's at start, in
    pages of ``block_tokens`` (else the connector's). Without engines the demo's layout stays."""
    text = ENGINES.replace("port = 8200", "port = 8200\nblock_tokens = 64")
    cfg = load_config(_config(tmp_path, text))
    assert [n.layout for n in cfg.nodes] == ["", ""]
    serving = serving_config(cfg)
    assert serving is not None
    extras = [
        kv_transfer_config(e, {"address": "127.0.0.1:7000", "layout": ""}, None, None)
        for e in serving.engines
    ]
    p0, d0 = (x["kv_connector_extra_config"] for x in extras)
    assert p0 == {"node": "127.0.0.1:7000"}  # model and block size: the connector's own
    assert d0 == {"node": "127.0.0.1:7000", "block_tokens": 64}
    named = "model=m,num_layers=2,kv_heads=2,head_dim=32"
    one = NODES.replace('role = "decode"', f'role = "decode"\nlayout = "{named}"')
    path = tmp_path / "one.toml"
    path.write_text(one + ENGINES)
    assert [n.layout for n in load_config(str(path)).nodes] == ["", named]
    every = load_config(_config(tmp_path, f'[defaults]\nlayout = "{named}"\n' + ENGINES))
    assert [n.layout for n in every.nodes] == [named, named]
    none = load_config(_config(tmp_path, '[defaults]\nlayout = "none"\n'))
    assert [n.layout for n in none.nodes] == ["", ""]
    assert all(n.layout for n in load_config(_config(tmp_path, "")).nodes)  # the demo's


def test_the_embedded_default_has_no_engines():
    assert serving_config(load_config(None)) is None


@pytest.mark.parametrize(
    "text, says",
    [
        (ENGINES.replace("port = 8200", "gpu = 1"), "unknown key 'gpu'"),
        (ENGINES.replace('node = "d0"', 'node = "d9"'), "not a [[node]] id"),
        (ENGINES + '[[engines]]\nnode = "p0"\n', "one [[engines]] entry per node"),
        (ENGINES.replace("port = 8200", 'kv_role = "decoder"'), "kv_role must be one of"),
        (ENGINES.replace('model = "models/tiny"', ""), "no model"),
        (ENGINES.replace("port = 8200", "port = 99999"), "a port is 0..65535"),
        (ENGINES.replace('["--block-size", "32"]', '"--enforce-eager"'), "list of strings"),
        (ENGINES.replace("port = 8200", 'env = ["NOEQUALS"]'), "NAME=VALUE"),
        (ENGINES.replace("port = 8200", "block_tokens = -64"), "a number of tokens"),
        (ENGINES + "[router]\nport = 1\n", "unknown key 'port'"),
        ('[router]\nlisten = "127.0.0.1:8000"\n', "needs [[engines]]"),
        (
            ENGINES.replace("port = 8200", 'served_model_name = "other"'),
            "the same served_model_name",
        ),
    ],
)
def test_config_mistakes_name_the_key(tmp_path, text, says):
    with pytest.raises(ConfigError) as e:
        serving_config(load_config(_config(tmp_path, text)))
    assert says in str(e.value)


def test_kvcache_up_refuses_a_bad_engines_section_before_starting_anything(tmp_path):
    config = _config(tmp_path, ENGINES.replace('node = "d0"', 'node = "d9"'))
    state = tmp_path / "state"
    proc = subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "up", "--config", config, "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "(node 'd9'): not a [[node]] id" in proc.stderr
    assert not (state / "cluster.json").exists()


def test_kvcache_down_stops_engines_first_as_process_groups():
    from kvcache.cluster_down import engine_groups, stop_stages

    state = json.loads(
        """{"nodes": [{"pids": [10, 11]}], "engines": [{"pid": 30}, {"pid": 20}],
            "router": {"pid": 40}, "pids": [1, 10, 11, 30, 20, 40]}"""
    )
    assert stop_stages(state) == [[40], [20, 30], [11], [10], [1]]
    assert engine_groups(state) == {20, 30}
