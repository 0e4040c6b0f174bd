"""A real etcd server for ``kvcache up --etcd`` (and the tests): Debian's ``etcd-server`` package,
one member on free ports, its data in a directory of ours.

``start_etcd`` returns once etcd answers ``/health``; the process's stderr goes to a log file whose
tail is shown when it fails to start. The member keeps its data across restarts of the same
``data_dir`` (leases included), which is what an etcd outage looks like to the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from plumbing.launch import ServiceProcess, child_environ, free_port
from rpc.tls import TlsFiles

INSTALL_HINT = "install Debian's etcd-server package (apt-get install etcd-server; make does it)"


def etcd_binary() -> str:
    path = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if path is None:
        raise RuntimeError(f"no etcd binary on PATH: {INSTALL_HINT}")
    return path


@dataclass
class EtcdServer:
    """One etcd member: ``endpoint`` is its client URL (what ``--etcd`` takes); ``process``
    stops (SIGTERM: etcd syncs and exits) and kills it like any role's process."""

    process: ServiceProcess
    endpoint: str
    peer_url: str
    data_dir: str
    name: str
    wrap: tuple[str, ...] = ()
    tls: TlsFiles | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, timeout_s: float = 10.0) -> int:
        return self.process.stop(timeout_s)

    def kill(self) -> None:
        self.process.kill()

    def restart(self, timeout_s: float = 30.0) -> "EtcdServer":
        """The same member again (same ports, same data): an outage that ends."""
        self.stop()
        return start_etcd(
            self.data_dir,
            client_url=self.endpoint,
            peer_url=self.peer_url,
            name=self.name,
            log_path=self.process.log_path,
            timeout_s=timeout_s,
            wrap=list(self.wrap),
            tls=self.tls,
        )


def healthy(endpoint: str, timeout_s: float = 1.0, tls: TlsFiles | None = None) -> bool:
    context = None
    if tls is not None:  # verified, and with a client certificate: etcd wants one
        context = ssl.create_default_context(cafile=tls.ca_cert)
        context.load_cert_chain(tls.cert, tls.key)
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=timeout_s, context=context) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except (OSError, ValueError, urllib.error.URLError):
        return False


def start_etcd(
    data_dir: str,
    host: str = "127.0.0.1",
    *,
    client_url: str | None = None,
    peer_url: str | None = None,
    name: str = "kvcache",
    log_path: str | None = None,
    timeout_s: float = 30.0,
    wrap: list[str] | None = None,
    tls: TlsFiles | None = None,
) -> EtcdServer:
    """Start one etcd member with its data in ``data_dir`` on free ports of ``host`` (or the
    given URLs) and wait until it is healthy. ``wrap`` runs it elsewhere (``ip netns exec NS``;
    give its URLs then: free ports are looked up here). ``tls``: clients speak TLS to it and
    must present a certificate of its CA (``--client-cert-auth``): only the cluster's processes
    may read or write its membership and election."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    scheme = "https" if tls is not None else "http"
    client_url = client_url or f"{scheme}://{host}:{free_port(host)}"
    peer_url = peer_url or f"http://{host}:{free_port(host)}"
    log_path = log_path or os.path.join(os.path.dirname(os.path.abspath(data_dir)), "etcd.log")
    args = [
        *(wrap or []),
        etcd_binary(),
        "--name",
        name,
        "--data-dir",
        data_dir,
        "--listen-client-urls",
        client_url,
        "--advertise-client-urls",
        client_url,
        "--listen-peer-urls",
        peer_url,
        "--initial-advertise-peer-urls",
        peer_url,
        "--initial-cluster",
        f"{name}={peer_url}",
        # A watch with nothing to report still hears from etcd this often, so a silent
        # stream means a dead one (plumbing.etcd.Watch's idle timeout is longer).
        "--experimental-watch-progress-notify-interval",
        "5s",
        "--logger",
        "zap",
        "--log-outputs",
        "stderr",
    ]
    if tls is not None:
        args += ["--cert-file", tls.cert, "--key-file", tls.key]
        args += ["--client-cert-auth", "--trusted-ca-file", tls.ca_cert]
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=log_file, text=True, env=child_environ()
        )
    process = ServiceProcess("etcd", proc, {"address": client_url}, log_path)
    server = EtcdServer(process, client_url, peer_url, data_dir, name, tuple(wrap or ()), tls)
    deadline = time.monotonic() + timeout_s
    while not healthy(client_url, timeout_s=0.5, tls=tls):
        if proc.poll() is not None or time.monotonic() > deadline:
            server.kill()
            tail = process.log()[-2000:]
            raise RuntimeError(
                f"etcd did not become healthy at {client_url} "
                f"(exit code {proc.returncode}); its log {log_path} ends:\n{tail}"
            )
        time.sleep(0.05)
    return server


def etcd_role_args(etcd: dict[str, Any], cfg: Any) -> list[str]:
    """The flags every role of a ``kvcache up`` cluster takes to use ``etcd`` (cluster.json's
    entry: endpoints, prefix, TLS files) with the config's ``[etcd] ttl``."""
    tls = etcd.get("tls") or {}
    files = [("--etcd-ca", tls.get("ca")), ("--etcd-cert", tls.get("cert"))]
    files.append(("--etcd-key", tls.get("key")))
    return [flag for f, path in files if path for flag in (f, path)] + [
        "--etcd",
        ",".join(etcd["endpoints"]),
        "--etcd-prefix",
        etcd["prefix"],
        "--etcd-ttl",
        str(cfg.get("etcd", "ttl")),
    ]
