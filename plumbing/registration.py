"""The member side of cluster membership in etcd: where each member's record lives, how it is
encoded, and ``Registration``, the thread with which a node or messenger keeps its record alive
under a lease (a conductor campaigns with its ``ConductorRecord``). The conductor side, which
learns the membership from a watch of these keys, is ``conductor/membership_watch.py``.

Keys under the prefix (``--etcd-prefix``, default ``/kvcache``):

- ``<prefix>/nodes/<node_id>``: a node server (``NodeRecord``: its descriptor, as
  ``RegisterNode`` carries it, its load, and an incarnation id per process start);
- ``<prefix>/messengers/<node_id>``: the node's messenger (``MessengerRecord``);
- ``<prefix>/conductor/leader``: the conductors' election (etcd's v3election: candidates are
  ``.../leader/<lease>`` keys, the oldest leads; its value is the leader's ``ConductorRecord``).

Records are JSON (the descriptor and load in protobuf's JSON mapping), readable with
``etcdctl get --prefix /kvcache``. Each is attached to its process's lease: a process that dies
stops renewing it and etcd deletes the key when the TTL lapses; a clean stop revokes it at once.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from google.protobuf import json_format

from kvstore.errors import InvalidArgument
from proto import common_pb2 as cpb
from proto import conductor_pb2 as pb
from rpc.cluster import NodeDescriptor, NodeLoad
from rpc.wire import descriptor_from_pb, descriptor_to_pb, load_from_pb, load_to_pb

from .etcd import (
    DEFAULT_PREFIX,
    EtcdClient,
    EtcdError,
    EtcdUnavailable,
    check_prefix,
    parse_endpoints,
)

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 5
LEADER_METADATA = "kvcache-leader"  # trailing metadata of a standby's redirect: the leader
LOAD_REFRESH_S = 5.0  # a node's record is rewritten for a load change at most this often


def nodes_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}/nodes/"


def messengers_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}/messengers/"


def election_name(prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}/conductor/leader"


def new_incarnation() -> str:
    """Names one start of a process: a record with a new incarnation is a restarted process
    (its store is new), the same incarnation under a new lease is the same process."""
    return uuid.uuid4().hex


@dataclass(frozen=True, kw_only=True)
class NodeRecord:
    descriptor: NodeDescriptor
    load: NodeLoad
    incarnation: str

    def encode(self) -> bytes:
        return json.dumps(
            {
                "incarnation": self.incarnation,
                "node": json_format.MessageToDict(descriptor_to_pb(self.descriptor)),
                "load": json_format.MessageToDict(load_to_pb(self.load)),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> "NodeRecord":
        """InvalidArgument when ``data`` is not a node record."""
        try:
            raw = json.loads(data)
            node = json_format.ParseDict(raw["node"], pb.NodeDescriptor())
            load = json_format.ParseDict(raw.get("load", {}), cpb.NodeLoad())
            return cls(
                descriptor=descriptor_from_pb(node),
                load=load_from_pb(load),
                incarnation=str(raw["incarnation"]),
            )
        except (ValueError, KeyError, TypeError, json_format.ParseError) as e:
            raise InvalidArgument(f"not a node record: {e}") from None


@dataclass(frozen=True, kw_only=True)
class MessengerRecord:
    node_id: str
    address: str  # MessengerService (gRPC)
    data_address: str = ""
    transport: str = ""

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "MessengerRecord":
        try:
            raw = json.loads(data)
            return cls(
                node_id=str(raw["node_id"]),
                address=str(raw["address"]),
                data_address=str(raw.get("data_address", "")),
                transport=str(raw.get("transport", "")),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"not a messenger record: {e}") from None


@dataclass(frozen=True, kw_only=True)
class ConductorRecord:
    """The value a conductor campaigns with: where clients reach it."""

    address: str
    conductor_id: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes) -> "ConductorRecord":
        try:
            raw = json.loads(data)
            return cls(address=str(raw["address"]), conductor_id=str(raw.get("conductor_id", "")))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"not a conductor record: {e}") from None


class Registration:
    """Keeps ``key`` = ``value()`` in etcd under a lease of ``ttl_s`` seconds, renewed every
    ttl/3. A lease etcd lost (it lapsed while etcd was out of reach, or etcd lost its data) is
    replaced and the key written again; a changed ``value()`` is rewritten at most every
    ``refresh_s``. An unreachable etcd is retried and reported once per outage; the process
    goes on serving meanwhile. ``stop()`` revokes the lease, deleting the key at once."""

    def __init__(
        self,
        etcd: EtcdClient,
        key: str,
        value: Callable[[], bytes],
        ttl_s: int = DEFAULT_TTL_S,
        refresh_s: float = LOAD_REFRESH_S,
    ) -> None:
        if ttl_s < 1:
            raise InvalidArgument(f"etcd lease TTL must be at least 1 s, got {ttl_s}")
        self.etcd, self.key, self._value = etcd, key, value
        self.ttl_s, self.refresh_s = int(ttl_s), refresh_s
        self.lease = 0
        self.registered = threading.Event()
        self.registrations = 0  # leases granted (1 + re-registrations)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"etcd-reg{key}")

    def start(self) -> "Registration":
        self._thread.start()
        return self

    def stop(self, revoke: bool = True) -> None:
        self._stop.set()
        self._thread.join(self.etcd.timeout_s * 2 + 1)
        if revoke and self.lease:
            try:
                self.etcd.revoke(self.lease)
            except (EtcdUnavailable, EtcdError) as e:
                log.info("etcd: could not revoke the lease of %s (%s); it lapses", self.key, e)
            self.lease = 0

    def _run(self) -> None:
        failing = False
        written = b""
        written_at = 0.0
        interval = self.ttl_s / 3
        while not self._stop.is_set():
            try:
                if not self.lease:
                    lease = self.etcd.grant(self.ttl_s)
                    written = self._value()
                    self.etcd.put(self.key, written, lease)
                    self.lease, written_at = lease, time.monotonic()
                    self.registrations += 1
                    self.registered.set()
                    log.info(
                        "etcd: registered %s (lease %x, ttl %d s)",
                        self.key,
                        lease,
                        lease and self.ttl_s,
                    )
                elif self.etcd.keepalive(self.lease) == 0:
                    log.warning(
                        "etcd: the lease of %s lapsed (etcd was out of reach longer than its "
                        "%d s TTL, or lost its data); registering again",
                        self.key,
                        self.ttl_s,
                    )
                    self.lease = 0
                    self.registered.clear()
                    continue
                elif time.monotonic() - written_at >= self.refresh_s:
                    value = self._value()
                    if value != written:
                        self.etcd.put(self.key, value, self.lease)
                        written, written_at = value, time.monotonic()
                if failing:
                    log.info("etcd reachable again; %s is registered", self.key)
                failing = False
                wait = interval
            except (EtcdUnavailable, EtcdError) as e:
                if not failing:
                    log.warning("etcd: cannot keep %s registered (%s); retrying", self.key, e)
                failing = True
                wait = min(interval, 1.0)
            except Exception:  # a broken value() must not end the registration silently
                log.exception("etcd: registering %s failed", self.key)
                wait = interval
            self._stop.wait(wait)


def add_etcd_args(parser: Any, defaults: bool = True) -> None:
    """``--etcd``, ``--etcd-prefix``, ``--etcd-ttl``: the same flags on every role.
    ``defaults=False`` leaves them None (a config file may set them; ``kvcache node``)."""
    parser.add_argument(
        "--etcd",
        default=None,
        metavar="URLS",
        help="etcd endpoints, comma-separated (e.g. http://10.77.0.1:2379): cluster membership "
        "and the conductors' election live there (default: none, embedded mode)",
    )
    parser.add_argument(
        "--etcd-prefix",
        default=DEFAULT_PREFIX if defaults else None,
        help=f"key prefix of this cluster in etcd (default {DEFAULT_PREFIX})",
    )
    parser.add_argument(
        "--etcd-ttl",
        dest="etcd_ttl_s",
        type=int,
        default=DEFAULT_TTL_S if defaults else None,
        metavar="SECONDS",
        help=f"lease of this process's etcd record, whole seconds (default {DEFAULT_TTL_S}): "
        "a process that dies disappears from the cluster this long after",
    )
    parser.add_argument(
        "--etcd-ca", default=None, metavar="PEM", help="CA to verify https:// etcd endpoints"
    )
    parser.add_argument(
        "--etcd-cert",
        default=None,
        metavar="PEM",
        help="this process's client certificate for an etcd that authenticates its clients "
        "(--client-cert-auth): only the cluster's processes may write its membership",
    )
    parser.add_argument("--etcd-key", default=None, metavar="PEM", help="--etcd-cert's key")


@dataclass(frozen=True)
class EtcdTls:
    """``--etcd-ca`` / ``--etcd-cert`` / ``--etcd-key``."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def client(self, endpoints: Any) -> EtcdClient:
        return EtcdClient(
            endpoints, ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file
        )


def etcd_tls(role: str, args: Any) -> EtcdTls:
    """The checked etcd TLS flags (a SystemExit naming the flag to fix)."""
    ca, cert, key = args.etcd_ca, args.etcd_cert, args.etcd_key
    if bool(cert) != bool(key):
        raise SystemExit(f"kvcache {role}: --etcd-cert and --etcd-key go together")
    for flag, path in (("--etcd-ca", ca), ("--etcd-cert", cert), ("--etcd-key", key)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"kvcache {role}: {flag}: no such file {path}")
    return EtcdTls(ca, cert, key)


def etcd_settings(role: str, endpoints: str, prefix: str, ttl_s: int) -> tuple[list[str], str]:
    """Checked ``--etcd`` / ``--etcd-prefix`` / ``--etcd-ttl``: (endpoints, prefix); a
    SystemExit that names the flag to fix otherwise."""
    try:
        urls = parse_endpoints(endpoints)
        prefix = check_prefix(prefix)
    except ValueError as e:
        raise SystemExit(f"kvcache {role}: --etcd: {e}") from None
    if not 1 <= ttl_s <= 3600:
        raise SystemExit(f"kvcache {role}: --etcd-ttl must be 1..3600 seconds, got {ttl_s}")
    return urls, prefix
