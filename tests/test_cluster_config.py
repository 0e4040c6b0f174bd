"""The cluster config as a user meets it: ``kvcache up --print-config`` shows the merged result of
flags > environment > config file > defaults, and a broken config gets a message that names the
key and where it is, with exit code 2, never a traceback."""

from __future__ import annotations

import tomllib

import pytest

from kvcache.cluster_config import SECTIONS, TABLES, ConfigError, env_name, load_config

from helpers import kvcache_cli


def printed(*args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> dict:
    r = kvcache_cli("up", "--print-config", *args, env=env, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    return tomllib.loads(r.stdout)


def fails(*args: str, env: dict[str, str] | None = None) -> str:
    r = kvcache_cli("up", *args, env=env)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stdout == ""
    return r.stderr.strip()


def test_precedence_flags_over_environment_over_file_over_defaults(tmp_path):
    config = tmp_path / "cluster.toml"
    config.write_text(
        '[cluster]\nstate_dir = "st"\ntransport = "auto"\n\n'
        '[conductor]\npolicy = "load"\n\n[defaults]\ndram = "64MiB"\n'
    )
    defaults = printed(cwd=str(tmp_path))
    assert defaults["conductor"]["policy"] == "global-cache"
    assert defaults["cluster"]["state_dir"] == str(tmp_path / "out" / "cluster")
    assert [n["id"] for n in defaults["node"]] == ["prefill-0", "prefill-1", "decode-0"]

    from_file = printed("--config", str(config))
    assert from_file["conductor"]["policy"] == "load"
    assert from_file["cluster"]["transport"] == "auto"
    assert {n["dram"] for n in from_file["node"]} == {"64MiB"}  # [defaults] reach every node
    # A relative state_dir in a file is relative to the file, wherever kvcache runs.
    assert from_file["cluster"]["state_dir"] == str(tmp_path / "st")

    env = {"KVCACHE_CONDUCTOR_POLICY": "random", "KVCACHE_TRANSPORT": "rdma"}
    from_env = printed("--config", str(config), env=env)
    assert from_env["conductor"]["policy"] == "random"
    assert from_env["cluster"]["transport"] == "rdma"

    flags = printed(
        "--config",
        str(config),
        "--policy",
        "local-cache",
        "--set",
        "cluster.transport=tcp",
        env=env,
    )
    assert flags["conductor"]["policy"] == "local-cache"
    assert flags["cluster"]["transport"] == "tcp"
    assert flags["defaults"]["dram"] == "64MiB"  # untouched keys keep the file's value


def test_print_config_names_each_value_s_source(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text('[conductor]\npolicy = "load"\n')
    r = kvcache_cli(
        "up", "--print-config", "--config", str(config), "--tls", env={"KVCACHE_TOKEN": "s3cret"}
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert f'policy = "load"  # {config}' in lines
    assert "tls = true  # --tls" in lines
    assert 'token = "***"  # $KVCACHE_TOKEN' in lines  # shown set, never echoed
    assert "s3cret" not in r.stdout


# [hosts] values each key's own check accepts (a subnet, a name prefix, a tc rate, an MTU).
HOSTS_VALUES = {
    ("hosts", "subnet"): "10.9.8.0/24",
    ("hosts", "prefix"): "kv2",
    ("hosts", "rate"): "10gbit",
    ("hosts", "mtu"): "9000",
}


def test_every_known_key_has_an_environment_variable():
    for section, keys in SECTIONS.items():
        for k, key in keys.items():
            if (section, k) in HOSTS_VALUES:
                text = HOSTS_VALUES[section, k]
                want = int(text) if key.type is int else text
            elif key.type is bool:
                text, want = "true", True
            elif key.type is int:
                text, want = "7", 7
            elif key.type is float:
                text, want = "2.5", 2.5
            elif (section, k) == ("etcd", "endpoints"):
                text, want = "http://h:1 http://h:2", ["http://h:1", "http://h:2"]
            elif key.type is list:
                text, want = "--a 'b c'", ["--a", "b c"]
            elif key.choices:
                text = want = key.choices[-1]
            elif k == "state_dir":
                text, want = "/tmp/x", "/tmp/x"
            elif k in ("dram", "ssd"):
                text = want = "3MiB"
            elif k == "prefix":
                text = want = "/kv"
            elif k == "layout":
                text = want = "model=m,num_layers=1,kv_heads=1,head_dim=8"
            else:
                text = want = "value"
            cfg = load_config(None, env={env_name(section, k): text})
            assert cfg.settings[section][k] == want, (section, k)
            assert cfg.sources[f"{section}.{k}"] == f"${env_name(section, k)}"


def test_malformed_toml_is_a_message_with_the_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[cluster]\nstate_dir = "x"\n[conductor\npolicy = "load"\n')
    msg = fails("--config", str(bad))
    assert msg.startswith(f"kvcache up: {bad}: not valid TOML")
    assert "line 3" in msg


@pytest.mark.parametrize(
    "text, expect",
    [
        (
            '[conductor]\npolcy = "load"\n',
            "{path}:2: unknown key 'polcy' in [conductor] (did you mean 'policy'?",
        ),
        ('[clster]\nhost = "x"\n', "{path}: unknown section 'clster' (did you mean 'cluster'?"),
        (
            '[[node]]\nid = "a"\nrole = "prefill"\n\n'
            '[[node]]\nid = "b"\nrole = "decode"\ndramm = "1GiB"\n',
            "{path}:8: [[node]] #2 (id 'b'): unknown key 'dramm' (did you mean 'dram'?",
        ),
        ('[cluster]\ntls = "yes"\n', "{path}:2: [cluster] tls must be true or false, got 'yes'"),
        (
            '[conductor]\npolicy = "fastest"\n',
            "[conductor] policy must be one of random, round-robin, load",
        ),
        ('[[node]]\nid = "a"\n', "[[node]] #1 (id 'a'): every [[node]] needs 'role'"),
        (
            '[[node]]\nid = "a"\nrole = "prefill"\n[[node]]\nid = "a"\nrole = "decode"\n',
            "[[node]] ids must be unique; a repeat",
        ),
        ('[defaults]\ndram = "lots"\n', "[defaults] dram: cannot parse size 'lots'"),
        ('[[node]]\nid = "a"\nrole = "both"\nmetrics_port = 70000\n', "a port is 0..65535"),
        ("[hosts]\ncount = -2\n", "{path}:2: [hosts] count: the number of hosts (0: every"),
        ('[hosts]\nsubnet = "10.77.0.0/33"\n', "[hosts] subnet: subnet '10.77.0.0/33' is not a"),
        ("[hosts]\nmtu = 100\n", "{path}:2: [hosts] mtu: mtu 100 is outside 576..65535"),
        ("[hosts]\nconductor_port = 0\n", "[hosts] conductor_port: a port is 1..65535"),
        ('[hosts]\nrate = "10gb"\n', "[hosts] rate: link rate '10gb' is not like 10gbit"),
        (
            "[hosts]\nnode_prot = 7000\n",
            "unknown key 'node_prot' in [hosts] (did you mean 'node_port'?",
        ),
    ],
)
def test_config_mistakes_name_the_key_and_where(tmp_path, text, expect):
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    msg = fails("--config", str(path))
    assert expect.format(path=path) in msg, msg


def test_hosts_follow_the_precedence_like_every_key(tmp_path):
    """[hosts] count: --hosts > $KVCACHE_HOSTS_COUNT > the file > 0 (loopback); --hosts 0 puts a
    file's hosts cluster back on loopback. The other [hosts] keys through env and --set."""
    config = tmp_path / "cluster.toml"
    config.write_text('[hosts]\ncount = 3\nrate = "1gbit"\n')
    assert printed()["hosts"]["count"] == 0
    assert printed("--config", str(config))["hosts"] == {
        **printed()["hosts"],
        "count": 3,
        "rate": "1gbit",
    }
    env = {"KVCACHE_HOSTS_COUNT": "2", "KVCACHE_HOSTS_SUBNET": "10.9.0.0/24"}
    from_env = printed("--config", str(config), env=env)["hosts"]
    assert (from_env["count"], from_env["subnet"]) == (2, "10.9.0.0/24")
    r = kvcache_cli(
        "up", "--print-config", "--config", str(config), "--hosts", "0",
        "--set", "hosts.rate=10gbit", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "count = 0  # --hosts" in lines
    assert 'rate = "10gbit"  # --set' in lines
    assert 'subnet = "10.9.0.0/24"  # $KVCACHE_HOSTS_SUBNET' in lines
    msg = fails("--print-config", "--hosts", "three")
    assert "--hosts: invalid int value: 'three'" in msg


def test_bad_environment_and_set_values_name_their_source(tmp_path):
    msg = fails("--print-config", env={"KVCACHE_TLS": "maybe"})
    assert msg == "kvcache up: $KVCACHE_TLS must be true or false, got 'maybe'"
    msg = fails("--print-config", "--set", "conductor.polcy=load")
    assert "unknown key 'polcy' in [conductor] (did you mean 'policy'?" in msg
    msg = fails("--print-config", "--set", "policy=load")
    assert "--set expects SECTION.KEY=VALUE" in msg
    msg = fails("--print-config", env={"KVCACHE_CONDUCTOR_METRICS_PORT": "http"})
    assert "$KVCACHE_CONDUCTOR_METRICS_PORT must be an integer, got 'http'" in msg
    msg = fails("--config", str(tmp_path / "absent.toml"))
    absent = tmp_path / "absent.toml"
    assert msg == f"kvcache up: cannot read cluster config {absent}: No such file or directory"


def test_adding_a_key_is_one_schema_line(monkeypatch):
    """What another change does to add a key: one entry; env, --set and defaults follow."""
    from kvcache import cluster_config as cc

    monkeypatch.setitem(cc.SECTIONS["cluster"], "etcd", cc.Key(str, "", "etcd endpoints"))
    monkeypatch.setitem(cc.TABLES["node"], "engine", cc.Key(str, "none", "engine kind"))
    cfg = cc.load_config(None, env={"KVCACHE_ETCD": "127.0.0.1:2379"})
    assert cfg.get("cluster", "etcd") == "127.0.0.1:2379"
    assert cfg.nodes[0].settings["engine"] == "none"
    with pytest.raises(ConfigError, match="unknown key 'etcdd' in \\[cluster\\]"):
        cc.load_config(None, sets=["cluster.etcdd=x"])
    assert set(TABLES) == {"node", "engines"}
