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
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from plumbing.launch import ServiceProcess, child_environ, free_port

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
        )


def healthy(endpoint: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/health", timeout=timeout_s) as r:
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
) -> EtcdServer:
    """Start one etcd member with its data in ``data_dir`` on free ports of ``host`` (or the
    given URLs) and wait until it is healthy. ``wrap`` runs it elsewhere (``ip netns exec NS``;
    give its URLs then: free ports are looked up here)."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    client_url = client_url or f"http://{host}:{free_port(host)}"
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
    with open(log_path, "ab") as log_file:
        proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=log_file, text=True, env=child_environ()
        )
    process = ServiceProcess("etcd", proc, {"address": client_url}, log_path)
    server = EtcdServer(process, client_url, peer_url, data_dir, name, tuple(wrap or ()))
    deadline = time.monotonic() + timeout_s
    while not healthy(client_url, timeout_s=0.5):
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
    entry: endpoints, prefix) with the config's ``[etcd] ttl``."""
    return [
        "--etcd",
        ",".join(etcd["endpoints"]),
        "--etcd-prefix",
        etcd["prefix"],
        "--etcd-ttl",
        str(cfg.get("etcd", "ttl")),
    ]
