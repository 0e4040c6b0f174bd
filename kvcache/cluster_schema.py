"""The schema of ``kvcache up``'s cluster config: every known key of its sections and tables, its
type, default, help and check (``kvcache.cluster_config`` reads a config against it).

Adding a key is one line in ``SECTIONS`` or ``TABLES`` (a new section or table of tables is one
entry there too); its environment variable and ``--set`` come with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_STATE_DIR = "out/cluster"
# 512-token blocks (the Mooncake trace's) and 256 KiB pages (4 layers x K|V x 512 tokens x 1 head
# x 32 dims x fp16): `make demo` moves a few hundred trace requests' pages through shared memory
# and the messengers' TCP in a few minutes on a 2-core machine. 1 GiB = 4096 pages per node.
DEMO_LAYOUT = "model=demo,num_layers=4,kv_heads=1,head_dim=32,dtype=float16,block_tokens=512"
KV_ROLES = ("producer", "consumer", "both")  # an engine's kv_role (kv_producer, ...)


@dataclass(frozen=True)
class Key:
    """One known key: its type (str, int, float, bool or list of str), default and meaning.
    ``flag``: a dedicated flag of ``kvcache up`` / ``down``; ``choices``: the allowed values;
    ``inherit``: a ``[defaults]`` key a ``[[table]]`` key falls back to; ``check``: raises
    ``ValueError`` or ``KVStoreError`` on a bad value (its message goes to the user)."""

    type: type
    default: Any
    help: str
    flag: str | None = None
    choices: tuple[str, ...] = ()
    required: bool = False
    inherit: str | None = None
    check: Callable[[Any], Any] | None = None


def _size(value: Any) -> None:
    from node.config import parse_size  # NOTE: lazily: `kvcache --help` imports no node code

    parse_size(value)


def _block_tokens(value: Any) -> None:
    if value < 0:
        raise ValueError(f"must be a number of tokens (0: the connector's), got {value}")


NO_LAYOUT = "none"  # a node that serves the layouts its clients register (an engine's at start)


def _layout(value: Any) -> None:
    from node.config import parse_layout

    if value != NO_LAYOUT:
        parse_layout(value)


def _replicas(value: Any) -> None:
    if value < 1:
        raise ValueError(f"at least 1 conductor, got {value}")


def _endpoints(value: Any) -> None:
    from plumbing.etcd import parse_endpoints  # NOTE: lazily, as the node's checks above

    if value:
        parse_endpoints(value)


def _prefix(value: Any) -> None:
    from plumbing.etcd import check_prefix

    check_prefix(value)


def _ttl(value: Any) -> None:
    if not 1 <= value <= 3600:
        raise ValueError(f"an etcd lease is 1..3600 seconds, got {value}")


def _port(value: Any) -> None:
    if not 0 <= value <= 65535:
        raise ValueError(f"a port is 0..65535 (0: any free port), got {value}")


def _fixed_port(value: Any) -> None:
    if not 1 <= value <= 65535:
        raise ValueError(f"a port is 1..65535 (fixed: peers are told it up front), got {value}")


def _hosts(value: Any) -> None:
    if value < 0:
        raise ValueError(f"the number of hosts (0: every process on loopback), got {value}")


def _netns(name: str, empty_ok: bool = False) -> Callable[[Any], Any]:
    """A check of ``plumbing.netns`` (``NetnsError``, a RuntimeError there) as a config check."""

    def check(value: Any) -> None:
        from plumbing import netns  # NOTE: lazily, as the node's checks above

        if empty_ok and value == "":
            return
        try:
            getattr(netns, name)(value)
        except netns.NetnsError as e:
            raise ValueError(str(e)) from None

    return check


# ---- the schema: add a key here ---------------------------------------------------------------

SECTIONS: dict[str, dict[str, Key]] = {
    "cluster": {
        "host": Key(str, "127.0.0.1", "address every process binds", flag="--host"),
        "state_dir": Key(
            str, DEFAULT_STATE_DIR, "cluster.json, logs, token, TLS files", flag="--state-dir"
        ),
        "token": Key(str, "", "require this bearer token on every service (empty: none)"),
        "transport": Key(str, "tcp", "messenger transport", choices=("tcp", "rdma", "auto")),
        "tls": Key(bool, False, "TLS on every gRPC link, from a local CA", flag="--tls"),
        "metrics_host": Key(
            str, "127.0.0.1", "address the Prometheus endpoints bind", flag="--metrics-host"
        ),
    },
    "conductor": {
        "policy": Key(
            str,
            "global-cache",
            "scheduling policy",
            flag="--policy",
            choices=("random", "round-robin", "load", "local-cache", "global-cache"),
        ),
        "args": Key(list, [], "more 'kvcache conductor' flags"),
        "metrics_port": Key(int, 0, "its Prometheus port (0: any free port)", check=_port),
        "replicas": Key(
            int,
            1,
            "conductors: more than 1 needs [etcd] (one leads, the others stand by)",
            check=_replicas,
        ),
    },
    "etcd": {
        "enabled": Key(
            bool, False, "membership and the conductors' election in etcd", flag="--etcd"
        ),
        "endpoints": Key(
            list, [], "etcd client URLs (empty: kvcache up starts its own etcd)", check=_endpoints
        ),
        "prefix": Key(str, "/kvcache", "this cluster's key prefix in etcd", check=_prefix),
        "ttl": Key(int, 5, "etcd lease of every process, seconds", check=_ttl),
    },
    # kvcache up --hosts N: hosts in network namespaces on a bridge (kvcache/cluster_hosts.py).
    "hosts": {
        "count": Key(
            int,
            0,
            "hosts in network namespaces, nodes round-robin, conductors and etcd in another "
            "(0: all on loopback; needs root)",
            flag="--hosts",
            check=_hosts,
        ),
        "subnet": Key(
            str,
            "10.77.0.0/24",
            "the bridge's network: .1 the bridge, .2 conductors",
            check=_netns("check_subnet"),
        ),
        "prefix": Key(
            str,
            "kvc",
            "names: netns <prefix>-ctl, -h0 ..., bridge <prefix>-br",
            check=_netns("check_prefix"),
        ),
        "rate": Key(
            str,
            "",
            "tc tbf cap on every link, each way, e.g. 10gbit (empty: none)",
            check=_netns("parse_rate", empty_ok=True),
        ),
        "mtu": Key(int, 1500, "the links' MTU", check=_netns("check_mtu")),
        "node_port": Key(
            int, 7000, "a host's k-th node listens on node_port + k", check=_fixed_port
        ),
        "messenger_port": Key(int, 7100, "its messenger, + k", check=_fixed_port),
        "data_port": Key(int, 7200, "its messenger's data port, + k", check=_fixed_port),
        "conductor_port": Key(int, 7300, "the i-th conductor's, + i", check=_fixed_port),
        "engine_port": Key(
            int, 8000, "the vLLM engine beside a host's k-th node, + k", check=_fixed_port
        ),
        "etcd_port": Key(int, 2379, "etcd's client port ([etcd] enabled)", check=_fixed_port),
        "etcd_peer_port": Key(int, 2380, "etcd's peer port", check=_fixed_port),
    },
    "defaults": {
        "layout": Key(
            str,
            DEMO_LAYOUT,
            "a node's layout unless it names one; 'none': what its clients register (the default "
            "of a cluster with [[engines]]: each engine's connector registers its model's)",
            check=_layout,
        ),
        "dram": Key(str, "1GiB", "a node's DRAM tier unless it names one", check=_size),
        "ssd": Key(str, "0", "a node's SSD tier unless it names one (0: none)", check=_size),
    },
    # vLLM engines beside their nodes and the router in front (kvcache/engines.py).
    "engine_defaults": {
        "model": Key(
            str,
            "",
            "an engine's model directory unless it names one (relative: to the config file)",
        ),
        "served_model_name": Key(
            str, "", "the model name engines serve (default: the directory's name)"
        ),
        "kv_role": Key(
            str, "", "producer | consumer | both (default: by node role)", choices=("", *KV_ROLES)
        ),
        "args": Key(list, [], "more 'vllm serve' flags for every engine"),
        "env": Key(list, [], "NAME=VALUE environment entries for every engine"),
        "start_timeout_s": Key(float, 300.0, "seconds an engine may take to answer /health"),
        "pool": Key(
            bool,
            False,
            "engines load prefixes cached on any node: found in the conductor's index, pulled "
            "into their node by its messenger (the connector's 'conductor')",
        ),
        "block_tokens": Key(
            int,
            0,
            "tokens per kvcache page of an engine on a node without a layout (0: the "
            "connector's, 256; a node's layout sets its own)",
            check=_block_tokens,
        ),
    },
    "router": {
        "listen": Key(str, "", "host:port of 'kvcache router' (empty: no router)"),
        "mode": Key(
            str,
            "disaggregated",
            "disaggregated (prefill and decode engines) or aggregated (one engine of a node of "
            "role both per request, chosen by cache hit and load)",
            choices=("disaggregated", "aggregated"),
        ),
        "disaggregate_above": Key(
            int,
            0,
            "aggregated: requests whose uncached suffix is longer go disaggregated (0: never)",
        ),
        "args": Key(list, [], "more 'kvcache router' flags"),
    },
}

# Arrays of tables ([[node]]): one entry per table kind.
TABLES: dict[str, dict[str, Key]] = {
    "node": {
        "id": Key(str, None, "node id", required=True),
        "role": Key(str, None, "", required=True, choices=("prefill", "decode", "both")),
        "layout": Key(str, None, "", inherit="layout", check=_layout),
        "dram": Key(str, None, "", inherit="dram", check=_size),
        "ssd": Key(str, None, "", inherit="ssd", check=_size),
        "metrics_port": Key(int, 0, "the node's Prometheus port (0: any)", check=_port),
        "messenger_metrics_port": Key(int, 0, "its messenger's (0: any)", check=_port),
    },
    # Unset keys (None) come from [engine_defaults].
    "engines": {
        "node": Key(str, None, "the [[node]] id it serves beside", required=True),
        "model": Key(str, None, ""),
        "served_model_name": Key(str, None, ""),
        "kv_role": Key(str, None, "", choices=KV_ROLES),
        "port": Key(int, 0, "its HTTP port (0: any free port)", check=_port),
        "args": Key(list, None, ""),
        "env": Key(list, None, ""),
        "pool": Key(bool, None, ""),
        "block_tokens": Key(int, None, "", check=_block_tokens),
    },
}

DEFAULT_TABLES: dict[str, list[dict[str, Any]]] = {
    "node": [
        {"id": "prefill-0", "role": "prefill"},
        {"id": "prefill-1", "role": "prefill"},
        {"id": "decode-0", "role": "decode"},
    ],
    "engines": [],
}
