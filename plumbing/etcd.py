"""A small etcd v3 client for cluster metadata: keys, leases, watches and etcd's own election.

It talks to etcd's gRPC gateway (JSON over HTTP, ``/v3/...``) through ``etcd3gw``: that client
carries no protobuf or gRPC code of its own, so it cannot collide with the protobuf range
(5.29.6 .. 7.x) the engines pin beside us, it is maintained (OpenStack), and it is synchronous
like the threads of our servers. What this module adds on top:

- several endpoints: a call that cannot reach one endpoint tries the next (``EtcdUnavailable``
  when none answers), so one etcd member going away costs nothing;
- watches read to their end: etcd3gw's watch never tells its caller that the stream broke or
  that the revision was compacted; ``Watch`` raises ``EtcdUnavailable`` / ``WatchCompacted``, so
  the caller lists again and loses no change;
- etcd's election service (``v3election``: Campaign, Leader, Resign), which etcd3gw does not
  wrap: the same election recipe as Go's ``concurrency.Election`` and ``etcdctl elect``, run by
  the etcd server, not a home-made protocol.
"""

from __future__ import annotations

import base64
import json
import logging
import socket
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

# NOTE: requests and etcd3gw are imported where first used: every node, messenger and client
# imports this module, most never talk to etcd, and the two cost ~0.15 s per process start.
if TYPE_CHECKING:
    import requests
    from etcd3gw.client import Etcd3Client

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/kvcache"


class EtcdUnavailable(Exception):
    """No endpoint answered (refused, timed out, or the member is not serving)."""


class EtcdError(Exception):
    """etcd answered, with an error (a request it refused)."""


class WatchIdle(EtcdUnavailable):
    """The watch heard nothing for its idle timeout (not even a progress notification): reopen
    it from the last revision seen."""


class WatchCompacted(Exception):
    """The watch's start revision was compacted away: list the keys again, then watch on."""


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    lease: int = 0
    create_revision: int = 0
    mod_revision: int = 0


@dataclass(frozen=True, slots=True)
class WatchEvent:
    deleted: bool  # False: a put
    kv: KeyValue


@dataclass(frozen=True, slots=True)
class WatchBatch:
    revision: int  # the store's revision when etcd sent the batch
    events: tuple[WatchEvent, ...]


def parse_endpoints(spec: str | Sequence[str]) -> list[str]:
    """``http://10.0.0.1:2379,http://10.0.0.2:2379`` (or a list of them) -> checked base URLs.
    Raises ValueError that says what to fix."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out = []
    for raw in (s.strip() for s in items):
        if not raw:
            continue
        url = urllib.parse.urlsplit(raw if "://" in raw else f"http://{raw}")
        try:
            port = url.port
        except ValueError:
            port = None
        if url.scheme not in ("http", "https") or not url.hostname or port is None:
            raise ValueError(
                f"etcd endpoint {raw!r} is not http(s)://HOST:PORT (e.g. http://127.0.0.1:2379)"
            )
        if url.path not in ("", "/"):
            raise ValueError(f"etcd endpoint {raw!r} has a path; give only http(s)://HOST:PORT")
        out.append(f"{url.scheme}://{url.netloc}")
    if not out:
        raise ValueError("no etcd endpoint given; e.g. --etcd http://127.0.0.1:2379")
    return out


def check_prefix(prefix: str) -> str:
    """The key prefix without a trailing slash; ValueError unless it starts with '/'."""
    if not prefix.startswith("/") or prefix.rstrip("/") == "" or "\x00" in prefix:
        raise ValueError(f"etcd prefix {prefix!r} must start with '/' and name a path: /kvcache")
    return prefix.rstrip("/")


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _prefix_end(prefix: str) -> str:
    """The range end of every key starting with ``prefix`` (its last byte plus one)."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return _b64(bytes(b))


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(item.get("key")).decode(errors="replace"),
        value=_unb64(item.get("value")),
        lease=int(item.get("lease", 0)),
        create_revision=int(item.get("create_revision", 0)),
        mod_revision=int(item.get("mod_revision", 0)),
    )


class Watch:
    """One watch stream over a key range: iterate for ``WatchBatch``es; ``close()`` from any
    thread ends it. Raises ``EtcdUnavailable`` when the stream breaks or stays silent longer
    than ``idle_timeout_s`` (reconnect from the last revision seen), ``WatchCompacted``."""

    def __init__(self, response: requests.Response) -> None:
        self._response = response
        self._closed = False

    def close(self) -> None:
        self._closed = True
        # NOTE: closing the response does not wake a thread blocked reading it; shutting the
        # socket down does (what etcd3gw's own Watcher.stop does too).
        try:
            fd = self._response.raw._fp.fileno()  # type: ignore[union-attr]
            with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except (AttributeError, OSError, ValueError):
            pass  # already closed
        self._response.close()

    def __iter__(self) -> Iterator[WatchBatch]:
        import requests
        import urllib3

        try:
            for line in self._response.iter_lines():
                if not line.strip():
                    continue
                result = json.loads(line).get("result")
                if result is None:  # the gateway reports a failed stream as {"error": ...}
                    raise EtcdUnavailable(f"etcd ended the watch: {line[:200]!r}")
                if result.get("canceled"):
                    compacted = int(result.get("compact_revision", 0))
                    if compacted:
                        raise WatchCompacted(f"revision compacted up to {compacted}")
                    reason = result.get("cancel_reason")
                    raise EtcdUnavailable(f"etcd cancelled the watch: {reason}")
                revision = int(result.get("header", {}).get("revision", 0))
                events = tuple(
                    WatchEvent(deleted=e.get("type") == "DELETE", kv=_kv(e["kv"]))
                    for e in result.get("events", ())
                )
                if events or not result.get("created"):
                    yield WatchBatch(revision, events)
        except (requests.RequestException, ValueError, AttributeError) as e:
            # NOTE: a response closed from another thread surfaces as one of these too.
            if self._closed:
                return
            if isinstance(e, requests.Timeout) or any(
                isinstance(a, urllib3.exceptions.ReadTimeoutError) for a in e.args
            ):
                raise WatchIdle("the watch stream was silent past its idle timeout") from None
            raise EtcdUnavailable(f"watch stream broke: {e}") from None
        if not self._closed:
            raise EtcdUnavailable("etcd closed the watch stream")


class EtcdClient:
    """etcd over its gRPC gateway, failing over between ``endpoints``. Thread-safe: each call
    is one HTTP request on a pooled connection."""

    def __init__(
        self,
        endpoints: str | Sequence[str],
        timeout_s: float = 2.0,
        ca_file: str | None = None,
        campaign_timeout_s: float = 30.0,
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> None:
        """``ca_file``: verify ``https://`` endpoints against it; ``cert_file`` / ``key_file``:
        this client's certificate, for an etcd that authenticates clients by theirs
        (``--client-cert-auth``: its common name is the etcd user)."""
        self.endpoints = parse_endpoints(endpoints)
        self.timeout_s = timeout_s
        import requests

        self._session = requests.Session()
        if ca_file:
            self._session.verify = ca_file
            # NOTE: else $REQUESTS_CA_BUNDLE, when set, replaces the cluster's CA per request.
            self._session.trust_env = False
        if cert_file:
            self._session.cert = (cert_file, key_file) if key_file else cert_file
        # One etcd3gw client per endpoint for ordinary calls, and one with a long read timeout
        # for Campaign, which blocks until its candidate leads; both share the session's pool.
        self._clients = [self._gateway(url, timeout_s) for url in self.endpoints]
        self._campaigners = [
            self._gateway(url, (timeout_s, campaign_timeout_s)) for url in self.endpoints
        ]
        self._current = 0

    def _gateway(self, url: str, timeout: Any) -> Etcd3Client:
        from etcd3gw.client import Etcd3Client

        parts = urllib.parse.urlsplit(url)
        return Etcd3Client(
            host=parts.hostname or "",
            port=parts.port or 2379,
            protocol=parts.scheme,
            timeout=timeout,
            api_path="/v3/",  # etcd >= 3.4; no discovery round trip
            session=self._session,
        )

    def close(self) -> None:
        self._session.close()

    def __enter__(self) -> "EtcdClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport --------------------------------------------------------------------------

    def _post(self, path: str, body: dict[str, Any], campaign: bool = False) -> dict[str, Any]:
        """POST to the current endpoint, moving on to the next one when it cannot be reached."""
        from etcd3gw import exceptions as gw_errors

        clients = self._campaigners if campaign else self._clients
        errors = []
        start = self._current
        for i in range(len(clients)):
            index = (start + i) % len(clients)
            client = clients[index]
            try:
                reply = client.post(client.get_url(path), json=body)
            except (gw_errors.ConnectionFailedError, gw_errors.ConnectionTimeoutError) as e:
                errors.append(f"{self.endpoints[index]}: {type(e).__name__}: {e.detail_text}")
                continue
            except gw_errors.Etcd3Exception as e:
                raise EtcdError(f"etcd refused {path}: {e.detail_text}") from None
            except ValueError as e:  # not JSON: something else listens there
                raise EtcdError(f"{self.endpoints[index]} is not etcd ({path}: {e})") from None
            self._current = index  # NOTE: a plain int store; a race only picks another endpoint
            return reply  # type: ignore[no-any-return]
        raise EtcdUnavailable("no etcd endpoint answered: " + "; ".join(e[:200] for e in errors))

    # ---- keys -------------------------------------------------------------------------------

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Returns the store revision of the write."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = lease
        return int(self._post("/kv/put", body).get("header", {}).get("revision", 0))

    def get(self, key: str) -> KeyValue | None:
        kvs = self._post("/kv/range", {"key": _b64(key)}).get("kvs", ())
        return _kv(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> tuple[int, list[KeyValue]]:
        """Every key under ``prefix`` and the store revision they were read at."""
        reply = self._post("/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        revision = int(reply.get("header", {}).get("revision", 0))
        return revision, [_kv(item) for item in reply.get("kvs", ())]

    def delete(self, key: str) -> bool:
        return int(self._post("/kv/deleterange", {"key": _b64(key)}).get("deleted", 0)) > 0

    # ---- leases -----------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        reply = self._post("/lease/grant", {"TTL": int(ttl_s), "ID": 0})
        if reply.get("error"):
            raise EtcdError(f"lease grant refused: {reply['error']}")
        return int(reply["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; its TTL in seconds, or 0 when etcd no longer has it (it lapsed)."""
        reply = self._post("/lease/keepalive", {"ID": lease})
        return max(int(reply.get("result", {}).get("TTL", 0)), 0)

    def revoke(self, lease: int) -> None:
        """Drop ``lease`` and every key attached to it (a lease already gone is fine)."""
        try:
            self._post("/lease/revoke", {"ID": lease})
        except EtcdError as e:
            if "not found" not in str(e):
                raise

    # ---- watches ----------------------------------------------------------------------------

    def watch_prefix(self, prefix: str, start_revision: int, idle_timeout_s: float = 15.0) -> Watch:
        """Changes of the keys under ``prefix`` from ``start_revision`` on."""
        body: dict[str, Any] = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _prefix_end(prefix),
                "start_revision": start_revision,
                "progress_notify": True,
            }
        }
        import requests

        errors = []
        for i in range(len(self._clients)):
            index = (self._current + i) % len(self._clients)
            client = self._clients[index]
            try:
                resp = client.session.post(
                    client.get_url("/watch"),
                    json=body,
                    stream=True,
                    timeout=(self.timeout_s, idle_timeout_s),
                )
            except requests.RequestException as e:
                errors.append(f"{self.endpoints[index]}: {e}")
                continue
            if resp.status_code != 200:
                resp.close()
                errors.append(f"{self.endpoints[index]}: HTTP {resp.status_code}")
                continue
            return Watch(resp)
        raise EtcdUnavailable("no etcd endpoint took the watch: " + "; ".join(errors))

    # ---- election (etcd's v3election service) -----------------------------------------------

    def campaign(self, name: str, lease: int, value: bytes) -> dict[str, Any]:
        """Block until this lease's candidate leads election ``name`` (etcd keeps the
        candidates as ``name/<lease>`` keys; the oldest leads). Returns the leader key to
        resign with. ``EtcdUnavailable`` after ``campaign_timeout_s``: campaign again (the
        same lease resumes the same candidate key)."""
        reply = self._post(
            "/election/campaign",
            {"name": _b64(name), "lease": lease, "value": _b64(value)},
            campaign=True,
        )
        if "leader" not in reply:
            raise EtcdError(f"campaign for {name} answered without a leader: {reply}")
        return reply["leader"]  # type: ignore[no-any-return]

    def leader(self, name: str) -> KeyValue | None:
        """The current leader's key and value, or None when nobody leads ``name``."""
        try:
            reply = self._post("/election/leader", {"name": _b64(name)})
        except EtcdError as e:
            if "no leader" in str(e):
                return None
            raise
        return _kv(reply["kv"]) if reply.get("kv") else None

    def resign(self, leader_key: dict[str, Any]) -> None:
        self._post("/election/resign", {"leader": leader_key})
