"""What ``kvcache deploy`` renders to keep a deployed cluster closed: its secrets (tokens and
certificates, ``kvcache deploy secrets``) and, on Kubernetes, the NetworkPolicies around it.

The manifests and the compose file hold no secret: they mount one (a Secret ``<name>-secrets``
at ``/etc/kvcache/secrets``, compose secrets at ``/run/secrets``) whose files are
``SECRET_FILES``. ``kvcache deploy secrets`` makes them fresh: random tokens (admin, service,
data, and one tenant, ``default``) and a CA with one certificate for every name the cluster's
processes are reached at (the StatefulSets' pod names under their headless Services, the
conductor's and etcd's Services, the compose services' host names).
"""

from __future__ import annotations

import base64
import os
import secrets
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .deploy import Spec

SECRET_FILES = (
    "admin-token",
    "service-token",
    "data-token",
    "tenant-tokens",
    "ca.pem",
    "server.pem",
    "server.key",
)
SECRETS_DIR = {"k8s": "/etc/kvcache/secrets", "compose": "/run/secrets"}
CERT_DAYS = 365


def secret_path(where: str, name: str) -> str:
    return f"{SECRETS_DIR[where]}/{name}"


def cert_names(spec: Spec) -> list[str]:
    """Every name a process of ``spec`` is reached at, on Kubernetes and in compose."""
    ns = spec.namespace
    headless = [f"{spec.name}-{r}" for r in spec.roles] + [f"{spec.name}-conductors"]
    names = [f"*.{svc}.{ns}.svc" for svc in [*headless, f"{spec.name}-etcd"]]
    for svc in (f"{spec.name}-conductor", f"{spec.name}-etcd"):
        names += [svc, f"{svc}.{ns}.svc"]
    names += ["etcd", *(f"conductor-{i}" for i in range(spec.conductors))]
    names += [f"node-{i}" for i in range(spec.prefill + spec.decode)]
    return names


def make_secrets(spec: Spec, hosts: list[str] | None = None) -> dict[str, bytes]:
    """Fresh contents of ``SECRET_FILES``; the certificate holds ``cert_names(spec)`` (or
    ``hosts``)."""
    from rpc.tls import make_local_ca

    with tempfile.TemporaryDirectory(prefix="kvcache-deploy-") as tmp:
        files = make_local_ca(tmp, hosts if hosts is not None else cert_names(spec), CERT_DAYS)
        out = {}
        for name, path in (("ca.pem", files.ca_cert), ("server.pem", files.cert)):
            with open(path, "rb") as f:
                out[name] = f.read()
        with open(files.key, "rb") as f:
            out["server.key"] = f.read()
    for name in ("admin-token", "service-token", "data-token"):
        out[name] = secrets.token_urlsafe(32).encode() + b"\n"
    out["tenant-tokens"] = f"{secrets.token_urlsafe(32)}=default\n".encode()
    return out


def secret_manifest(spec: Spec, contents: dict[str, bytes]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": f"{spec.name}-secrets",
            "labels": {"app.kubernetes.io/name": spec.name},
        },
        "type": "Opaque",
        "data": {k: base64.b64encode(v).decode() for k, v in contents.items()},
    }


def write_secret_files(directory: str, contents: dict[str, bytes]) -> None:
    """For compose: the files its ``secrets:`` name, 0600 (chown them to the image's user)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    for name, data in contents.items():
        path = os.path.join(directory, name)
        fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(f"{path}.tmp", path)


def network_policies(spec: Spec, ports: dict[str, int], health: dict[str, int],
                     metrics: dict[str, int]) -> list[dict[str, Any]]:  # fmt: skip
    """Ingress to the cluster's pods: nothing by default; everything between its own pods
    (etcd only from them); the nodes', messengers' and conductors' gRPC from pods labelled
    ``kvcache.io/client: "true"`` in the namespace (engines, routers, tools); the health ports
    from anywhere (probes); the metrics ports from pods labelled
    ``kvcache.io/metrics-reader: "true"`` in any namespace (Prometheus)."""
    app = {"app.kubernetes.io/name": spec.name}

    def policy(name: str, selector: dict[str, Any], ingress: list[dict]) -> dict[str, Any]:
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": f"{spec.name}-{name}", "labels": app},
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress},
        }

    def tcp(*numbers: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": p} for p in sorted(set(numbers))]

    served = {"matchLabels": app, "matchExpressions": [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["node", "conductor"]}
    ]}  # fmt: skip
    return [
        policy("default-deny", {"matchLabels": app}, []),
        policy(
            "internal", {"matchLabels": app}, [{"from": [{"podSelector": {"matchLabels": app}}]}]
        ),
        policy(
            "clients",
            served,
            [
                {
                    "from": [{"podSelector": {"matchLabels": {"kvcache.io/client": "true"}}}],
                    "ports": tcp(ports["node"], ports["messenger"], ports["conductor"]),
                }
            ],
        ),  # fmt: skip
        policy(
            "probes-and-scrapes",
            served,
            [
                {"ports": tcp(*health.values())},
                {
                    "from": [
                        {
                            "namespaceSelector": {},
                            "podSelector": {"matchLabels": {"kvcache.io/metrics-reader": "true"}},
                        }
                    ],
                    "ports": tcp(*metrics.values()),
                },
            ],
        ),  # fmt: skip
    ]
