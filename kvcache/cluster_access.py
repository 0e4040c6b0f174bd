"""How the operator's commands (``kvcache status``, ``kvcache drain``) find a running cluster:
the flags that name it and its credentials, and the reading of its cluster.json."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from rpc.server import TOKEN_ENV, add_token_file_arg

from .cluster_config import ENV_PREFIX, ConfigError, load_config

if TYPE_CHECKING:
    from bench.replay.live_engine import ClusterInfo


class NoCluster(Exception):
    """No cluster.json to read. ``config``: the cluster config could not be read (else the file
    could not); the message says why."""

    def __init__(self, message: str, config: bool) -> None:
        super().__init__(message)
        self.config = config


def add_access_args(parser: argparse.ArgumentParser, cluster: Any = None) -> None:
    """--cluster (on ``cluster``, a group, when given), --config, --token, --token-file and
    --tls-ca."""
    (cluster or parser).add_argument(
        "--cluster",
        help="cluster.json of 'kvcache up' (default: the one in the config's state_dir)",
    )
    parser.add_argument(
        "--config",
        default=os.environ.get(ENV_PREFIX + "CONFIG") or None,
        help="the cluster TOML 'kvcache up' was given (to find its state_dir)",
    )
    parser.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV) or None,
        help=f"the admin token (default: ${TOKEN_ENV}, else cluster.json's)",
    )
    add_token_file_arg(parser, "--token-file", "token", "the admin token, from a file")
    parser.add_argument(
        "--tls-ca", help="CA (PEM) of a cluster serving TLS (default: cluster.json's)"
    )


def read_cluster(args: argparse.Namespace) -> tuple["ClusterInfo", str]:
    """The cluster.json of ``--cluster``, else of ``--config``'s state_dir, and its path."""
    path = args.cluster
    if path is None:
        try:
            path = os.path.join(load_config(args.config).state_dir, "cluster.json")
        except ConfigError as e:
            raise NoCluster(str(e), config=True) from None
    from bench.replay.live_engine import LiveError, load_cluster

    try:
        return load_cluster(path), path  # the same reading as 'kvcache bench live'
    except LiveError as e:
        raise NoCluster(str(e), config=False) from None
