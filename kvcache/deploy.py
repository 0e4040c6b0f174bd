"""``kvcache deploy k8s|compose``: render the deployment files from one description.

Both files describe the same cluster: an etcd, ``--conductors`` conductors electing a leader in
etcd, and per role (``--prefill`` / ``--decode``) nodes, each node with its messenger beside it
sharing a memory-backed ``/dev/shm`` sized from ``--dram``. Every process serves on its own
pod's / container's address (``$(POD_IP)`` in Kubernetes, the service's host name in compose),
gRPC and metrics alike, never on loopback; it publishes the name its certificate holds in etcd
(``--advertise``: the pod's name under its headless Service, or the service's host name) and
finds the others there. The conductors elect their leader in etcd.

Closed by default (``deploy_security.py``): every process takes the admin, service and tenant
tokens and, for messengers, the data token from files of a mounted secret (``kvcache deploy
secrets`` makes them), serves TLS with the secret's certificate and verifies its peers against
its CA; etcd serves TLS to clients with a certificate of that CA only; probes ask a plaintext
health-only port (``--health-listen``); on Kubernetes, NetworkPolicies admit the cluster's own
pods, labelled clients, probes and labelled scrapers only.

- ``k8s``: plain manifests (``helm`` is not needed): a StatefulSet of nodes per role, each pod a
  node container and a messenger sidecar on one ``emptyDir`` (medium Memory) at ``/dev/shm``; a
  StatefulSet of conductors; an etcd StatefulSet unless ``--etcd`` names one; Services;
  NetworkPolicies; readiness and liveness probes on gRPC health (Kubernetes' own ``grpc`` probe
  on the health port: liveness on the server's ``""``, readiness on the node's and the
  messenger's service, and on ``""`` for conductors, so a standby is ready too); Prometheus
  scrape annotations (pods: the node's and the conductor's metrics port; a Service: the
  messengers').
- ``compose``: the same for ``docker compose``: a messenger joins its node's network and IPC
  namespaces (``network_mode`` / ``ipc: service:...``), so it maps the node's shared memory.

The committed files under ``deploy/`` are this command's output with its defaults
(``tests/test_deploy.py`` checks that they are current and valid).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from .deploy_security import (
    SECRET_FILES,
    SECRETS_DIR,
    make_secrets,
    network_policies,
    secret_manifest,
    secret_path,
    write_secret_files,
)

IMAGE = "kvcache:0.1.0"
ETCD_IMAGE = "gcr.io/etcd-development/etcd:v3.5.17"
UID = 10001  # the image's non-root user (Dockerfile)
PORTS = {"node": 7000, "messenger": 7100, "data": 7200, "conductor": 7300}
# Health alone, in plaintext, for probes (Kubernetes' grpc probe speaks no TLS): --health-listen.
HEALTH = {"node": 7010, "messenger": 7110, "conductor": 7310}
# The gRPC health service a pod's readiness probe asks (liveness asks "": the process serves).
# A conductor's is "" too: kvcache.v1.ConductorService is SERVING on the leader only, so a
# standby's pod would never be Ready (a rollout would stall); a standby redirects callers to
# the leader (FAILED_PRECONDITION naming it) and clients follow, so it may take connections.
READY_SERVICE = {
    "node": "kvcache.v1.NodeService",
    "messenger": "kvcache.v1.MessengerService",
    "conductor": "",
}
METRICS = {"node": 9100, "messenger": 9101, "conductor": 9100}
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@dataclass(frozen=True, kw_only=True)
class Spec:
    image: str = IMAGE
    prefill: int = 2
    decode: int = 1
    conductors: int = 2
    dram: str = "4GiB"
    layout: str = ""  # none: the nodes serve the layouts their engines register
    policy: str = "global-cache"
    # On SIGTERM (a scale-down, a drained Kubernetes host) a node hands its hottest blocks to
    # its peers first: up to this many bytes ("": not) within drain_seconds, while its
    # messenger, which the peers pull from, waits (preStop) that long before it stops.
    drain_bytes: str = "1GiB"
    drain_seconds: int = 20
    etcd: str = ""  # external endpoints; "" deploys one etcd member
    etcd_prefix: str = "/kvcache"
    name: str = "kvcache"
    namespace: str = "default"  # where the manifests go: in the names the certificate holds

    @property
    def roles(self) -> dict[str, int]:
        return {r: n for r, n in (("prefill", self.prefill), ("decode", self.decode)) if n}

    @property
    def etcd_urls(self) -> str:
        return self.etcd or f"https://{self.name}-etcd.{self.namespace}.svc:2379"

    def pod_name(self, service: str) -> str:
        """The name a StatefulSet's pod is reached at (its certificate holds it)."""
        return f"$(POD_NAME).{service}.{self.namespace}.svc"


def mib(size: str, flag: str = "--dram") -> int:
    """'4GiB' -> 4096 (binary units, as the node's --dram takes them)."""
    for unit, mult in UNITS.items():
        if size.endswith(unit):
            try:
                value = float(size.removesuffix(unit)) * mult
            except ValueError:
                break
            if value > 0:
                return int(-(-value // (1 << 20)))
    raise SystemExit(f"{flag} {size!r}: give a size like 4GiB or 512MiB")


def shm_mib(spec: Spec) -> int:
    """/dev/shm for one node: its DRAM tier plus room for the slab's header and a spare 10%."""
    dram = mib(spec.dram)
    return dram + max(64, dram // 10)


# ---- the command lines (shared by both files) -------------------------------------------------


@dataclass(frozen=True)
class Where:
    """Where one process runs: the address it listens on, the name it is reached at (and
    publishes), and which file's secrets it mounts (``k8s`` / ``compose``)."""

    listen: str
    name: str
    files: str

    def secret(self, name: str) -> str:
        return secret_path(self.files, name)


def etcd_flags(spec: Spec, at: Where) -> list[str]:
    flags = ["--etcd", spec.etcd_urls, "--etcd-prefix", spec.etcd_prefix]
    if spec.etcd_urls.startswith("https://"):  # the cluster's CA, its certificate as the client's
        flags += ["--etcd-ca", at.secret("ca.pem"), "--etcd-cert", at.secret("server.pem"),
                  "--etcd-key", at.secret("server.key")]  # fmt: skip
    return flags


def serve_flags(role: str, at: Where, metrics: str) -> list[str]:
    """Listen on the pod's address and publish (in etcd, in the leader election) the name its
    certificate holds; metrics on the pod's address too, where the scrape annotations point
    (the default metrics host is loopback); health alone on a plaintext port for probes; the
    tokens and the certificate from the mounted secret."""
    return ["--listen", f"{at.listen}:{PORTS[role]}", "--advertise", f"{at.name}:{PORTS[role]}",
            "--metrics-host", at.listen, "--metrics-port", str(METRICS[metrics]),
            "--health-listen", f"{at.listen}:{HEALTH[role]}",
            "--token-file", at.secret("admin-token"),
            "--tenant-tokens-file", at.secret("tenant-tokens"),
            "--service-token-file", at.secret("service-token"),
            "--tls-cert", at.secret("server.pem"),
            "--tls-key", at.secret("server.key")]  # fmt: skip


def conductor_args(spec: Spec, at: Where) -> list[str]:
    return ["conductor", *serve_flags("conductor", at, "conductor"), "--policy", spec.policy,
            "--node-tls-ca", at.secret("ca.pem"), "--node-token-file", at.secret("service-token"),
            *etcd_flags(spec, at)]  # fmt: skip


def node_args(spec: Spec, at: Where, node_id: str, role: str) -> list[str]:
    layout = ["--layout", spec.layout] if spec.layout else []  # none: what engines register
    drain = (["--drain-bytes", spec.drain_bytes, "--drain-seconds", str(spec.drain_seconds)]
             if spec.drain_bytes else [])  # fmt: skip
    return ["node", *serve_flags("node", at, "node"), "--node-id", node_id, "--role", role,
            "--dram", spec.dram, *layout, *drain,
            "--messenger", f"{at.name}:{PORTS['messenger']}", *etcd_flags(spec, at)]  # fmt: skip


def messenger_args(spec: Spec, at: Where) -> list[str]:
    return ["messenger", "--node", f"{at.name}:{PORTS['node']}",
            *serve_flags("messenger", at, "messenger"),
            "--data-listen", f"{at.listen}:{PORTS['data']}",
            "--data-advertise", f"{at.name}:{PORTS['data']}", "--transport", "tcp",
            "--node-tls-ca", at.secret("ca.pem"), "--data-token-file", at.secret("data-token"),
            *etcd_flags(spec, at)]  # fmt: skip


def etcd_command(name: str, advertise: str, files: str) -> list[str]:
    """One member serving TLS to clients with a certificate of the cluster's CA only; its peer
    port on loopback (one member: no peers); /health and /metrics in plaintext on 2381 (probes)."""
    d = SECRETS_DIR[files]
    return ["etcd", "--name", name, "--data-dir", "/var/lib/etcd",
            "--listen-client-urls", "https://0.0.0.0:2379",
            "--advertise-client-urls", advertise,
            "--listen-peer-urls", "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
            "--initial-cluster", f"{name}=http://127.0.0.1:2380",
            "--listen-metrics-urls", "http://0.0.0.0:2381",
            "--cert-file", f"{d}/server.pem", "--key-file", f"{d}/server.key",
            "--client-cert-auth", "--trusted-ca-file", f"{d}/ca.pem"]  # fmt: skip


# ---- Kubernetes ---------------------------------------------------------------------------------


def _labels(spec: Spec, component: str, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": spec.name, "app.kubernetes.io/component": component}
    if role:
        labels["kvcache.io/role"] = role
    return labels


def _scrape(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}  # fmt: skip


POD_ENV = [
    {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
]
POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": UID,
    "runAsGroup": UID,
    "fsGroup": UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


def _probes(port: int, ready_service: str) -> dict[str, Any]:
    """Kubernetes' gRPC probe calls grpc.health.v1 on the pod's address (every kvcache server
    serves it, without a token). Liveness is lenient: a busy node must not be restarted."""
    return {
        "readinessProbe": {
            "grpc": {"port": port, "service": ready_service},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "grpc": {"port": port, "service": ""},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
    }


SECRET_MOUNT = {"name": "secrets", "mountPath": SECRETS_DIR["k8s"], "readOnly": True}


def _secret_volume(spec: Spec) -> dict[str, Any]:
    # 0440: the pods' group (fsGroup) reads them, nobody else
    return {"name": "secrets", "secret": {"secretName": f"{spec.name}-secrets", "defaultMode": 288}}


def _container(
    spec: Spec, name: str, args: list[str], ports: dict[str, int], memory: str, mounts: list
) -> dict[str, Any]:
    """``name`` is the role (``node``, ``messenger``, ``conductor``); its gRPC port comes first
    in ``ports``; its health port is added, and probed."""
    health = {("msg-health" if name == "messenger" else "health"): HEALTH[name]}
    return {
        "name": name,
        "image": spec.image,
        "args": args,
        "env": POD_ENV,
        "ports": [
            {"name": n, "containerPort": p, "protocol": "TCP"}
            for n, p in {**ports, **health}.items()
        ],
        "resources": {
            "requests": {"cpu": "500m", "memory": memory},
            "limits": {"memory": memory},
        },
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, SECRET_MOUNT, *mounts],
        **_probes(HEALTH[name], READY_SERVICE[name]),
    }


def _outlive(seconds: int) -> dict[str, Any]:
    """A container that stops ``seconds`` after its pod is told to (preStop runs before its
    SIGTERM): the messenger, which the draining node's peers pull from."""
    if not seconds:
        return {}
    return {"lifecycle": {"preStop": {"sleep": {"seconds": seconds}}}}


def _service(
    spec: Spec, name: str, selector: dict, ports: dict[str, int], headless: bool, notes=None
) -> dict[str, Any]:
    svc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": selector, **({"annotations": notes} if notes else {})},
        "spec": {
            "selector": selector,
            "ports": [{"name": n, "port": p, "targetPort": p} for n, p in ports.items()],
        },
    }
    if headless:
        svc["spec"]["clusterIP"] = "None"
        svc["spec"]["publishNotReadyAddresses"] = True  # peers resolve a pod while it starts
    return svc


def render_k8s(spec: Spec) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    if not spec.etcd:
        labels = _labels(spec, "etcd")
        docs.append(_service(spec, f"{spec.name}-etcd", labels, {"client": 2379}, True))
        docs.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": f"{spec.name}-etcd", "labels": labels},
            "spec": {
                "serviceName": f"{spec.name}-etcd",
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "securityContext": POD_SECURITY,
                        "containers": [{
                            "name": "etcd",
                            "image": ETCD_IMAGE,
                            "command": etcd_command("etcd", spec.etcd_urls, "k8s"),
                            "ports": [{"name": "client", "containerPort": 2379},
                                      {"name": "probes", "containerPort": 2381}],
                            "securityContext": CONTAINER_SECURITY,
                            "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"},
                                             SECRET_MOUNT],
                            "readinessProbe": {"httpGet": {"path": "/health", "port": 2381}},
                            "livenessProbe": {"httpGet": {"path": "/livez", "port": 2381},
                                              "initialDelaySeconds": 10},
                        }],
                        "volumes": [_secret_volume(spec)],
                    },
                },
                "volumeClaimTemplates": [{
                    "metadata": {"name": "data"},
                    "spec": {"accessModes": ["ReadWriteOnce"],
                             "resources": {"requests": {"storage": "1Gi"}}},
                }],
            },
        })  # fmt: skip
    labels = _labels(spec, "conductor")
    docs.append(
        _service(spec, f"{spec.name}-conductor", labels, {"grpc": PORTS["conductor"]}, False)
    )
    # A StatefulSet: each conductor has a name under its headless Service that its
    # certificate holds (a Deployment's pods have none).
    peers = f"{spec.name}-conductors"
    docs.append(_service(spec, peers, labels, {"grpc": PORTS["conductor"]}, True))
    docs.append({
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": f"{spec.name}-conductor", "labels": labels},
        "spec": {
            "serviceName": peers,
            "replicas": spec.conductors,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels, "annotations": _scrape(METRICS["conductor"])},
                "spec": {
                    "securityContext": POD_SECURITY,
                    # One leader, hot standbys: keep them on different machines.
                    "affinity": {"podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [{
                            "weight": 100,
                            "podAffinityTerm": {"labelSelector": {"matchLabels": labels},
                                                "topologyKey": "kubernetes.io/hostname"},
                        }],
                    }},
                    "containers": [_container(
                        spec, "conductor",
                        conductor_args(spec, Where("$(POD_IP)", spec.pod_name(peers), "k8s")),
                        {"grpc": PORTS["conductor"], "metrics": METRICS["conductor"]}, "1Gi", [],
                    )],
                    "volumes": [{"name": "tmp", "emptyDir": {}}, _secret_volume(spec)],
                },
            },
        },
    })  # fmt: skip
    shm = [{"name": "dshm", "mountPath": "/dev/shm"}]
    node_memory = f"{shm_mib(spec) + 1024}Mi"  # the tmpfs pages count against the pod
    drain = spec.drain_seconds + 5 if spec.drain_bytes else 0  # the messenger outlives it
    for role in spec.roles:
        name = f"{spec.name}-{role}"
        labels = _labels(spec, "node", role)
        at = Where("$(POD_IP)", spec.pod_name(name), "k8s")
        docs.append(_service(spec, name, labels, {"grpc": PORTS["node"]}, True))
        docs.append({
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "serviceName": name,
                "replicas": spec.roles[role],
                "podManagementPolicy": "Parallel",
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels, "annotations": _scrape(METRICS["node"])},
                    "spec": {
                        "securityContext": POD_SECURITY,
                        # The node's drain on SIGTERM, then its own stop, within the grace.
                        "terminationGracePeriodSeconds": 30 + drain,
                        "containers": [
                            _container(
                                spec, "node", node_args(spec, at, "$(POD_NAME)", role),
                                {"grpc": PORTS["node"], "metrics": METRICS["node"]},
                                node_memory, shm,
                            ),
                            {**_container(
                                spec, "messenger", messenger_args(spec, at),
                                # NOTE: port names are unique in a pod, not per container
                                {"msg-grpc": PORTS["messenger"], "msg-data": PORTS["data"],
                                 "msg-metrics": METRICS["messenger"]},
                                "1Gi", shm,
                            ), **_outlive(drain)},
                        ],
                        "volumes": [
                            {"name": "tmp", "emptyDir": {}},
                            _secret_volume(spec),
                            # The node's DRAM tier: shared memory both containers map.
                            {"name": "dshm", "emptyDir": {"medium": "Memory",
                                                          "sizeLimit": f"{shm_mib(spec)}Mi"}},
                        ],
                    },
                },
            },
        })  # fmt: skip
    labels = _labels(spec, "node")
    docs.append(
        _service(
            spec,
            f"{spec.name}-messenger-metrics",
            labels,
            {"metrics": METRICS["messenger"]},
            True,
            _scrape(METRICS["messenger"]),
        )  # fmt: skip
    )
    metrics = {**METRICS, "messenger": METRICS["messenger"]}
    docs += network_policies(spec, PORTS, HEALTH, metrics)
    return docs


# ---- docker compose ---------------------------------------------------------------------------


def render_compose(spec: Spec) -> dict[str, Any]:
    base = {
        "image": spec.image,
        "build": {"context": "..", "dockerfile": "Dockerfile"},
        "read_only": True,
        "tmpfs": ["/tmp"],
        "restart": "unless-stopped",
        "secrets": list(SECRET_FILES),  # at /run/secrets/<name>
    }
    d = SECRETS_DIR["compose"]
    services: dict[str, Any] = {}
    if not spec.etcd:
        services["etcd"] = {
            "image": ETCD_IMAGE,
            "command": etcd_command("etcd", "https://etcd:2379", "compose"),
            "volumes": ["etcd-data:/var/lib/etcd"],
            "secrets": ["ca.pem", "server.pem", "server.key"],
            "healthcheck": {"test": ["CMD", "etcdctl", "--endpoints", "https://etcd:2379",
                                     "--cacert", f"{d}/ca.pem", "--cert", f"{d}/server.pem",
                                     "--key", f"{d}/server.key", "endpoint", "health"],
                            "interval": "5s", "retries": 10},
        }  # fmt: skip
    spec = Spec(**{**spec.__dict__, "etcd": spec.etcd or "https://etcd:2379"})
    after_etcd = {} if "etcd" not in services else {
        "depends_on": {"etcd": {"condition": "service_healthy"}}
    }  # fmt: skip
    for i in range(spec.conductors):
        host = f"conductor-{i}"
        services[host] = {
            **base, "hostname": host,
            "command": conductor_args(spec, Where(host, host, "compose")),
            "environment": {"KVCACHE_HEALTH_ADDR": f"{host}:{HEALTH['conductor']}"}, **after_etcd,
        }  # fmt: skip
    n = 0
    for role, count in spec.roles.items():
        for _ in range(count):
            host = f"node-{n}"
            at = Where(host, host, "compose")
            services[host] = {
                **base, "hostname": host, "command": node_args(spec, at, host, role),
                "ipc": "shareable", "shm_size": f"{shm_mib(spec)}m",
                "environment": {"KVCACHE_HEALTH_ADDR": f"{host}:{HEALTH['node']}"}, **after_etcd,
                # its drain on SIGTERM, then its own stop (docker stop's default is 10 s)
                "stop_grace_period": f"{30 + spec.drain_seconds if spec.drain_bytes else 10}s",
            }  # fmt: skip
            # The messenger lives in its node's network and IPC namespaces: the same address
            # and the same /dev/shm, as a Kubernetes sidecar does.
            services[f"messenger-{n}"] = {
                **base, "command": messenger_args(spec, at),
                "network_mode": f"service:{host}", "ipc": f"service:{host}",
                "environment": {"KVCACHE_HEALTH_ADDR": f"{host}:{HEALTH['messenger']}"},
                "depends_on": {host: {"condition": "service_healthy"}},
            }  # fmt: skip
            n += 1
    doc: dict[str, Any] = {"name": spec.name, "services": services}
    if "etcd" in services:
        doc["volumes"] = {"etcd-data": {}}
    # `kvcache deploy secrets --dir deploy/secrets` writes these files.
    doc["secrets"] = {name: {"file": f"./secrets/{name}"} for name in SECRET_FILES}
    return doc


# ---- command -----------------------------------------------------------------------------------

HEADER = """\
# Rendered by `kvcache deploy {what}` (kvcache/deploy.py); edit the renderer, not this file.
# {how}
"""


def dump(what: str, spec: Spec) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # no &id001 anchors: every service reads on its own

    def strings(dumper: yaml.SafeDumper, data: list) -> Any:
        flow = bool(data) and all(isinstance(x, str) for x in data)  # command lines on one line
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    Dumper.add_representer(list, strings)
    if what == "k8s":
        body = yaml.dump_all(render_k8s(spec), Dumper=Dumper, sort_keys=False, width=100)
        how = (
            f"docker build -t {spec.image} . && kvcache deploy secrets | kubectl apply -f - && "
            "kubectl apply -f deploy/kubernetes/kvcache.yaml"
        )
    elif what == "secrets":
        body = yaml.dump(
            secret_manifest(spec, make_secrets(spec)), Dumper=Dumper, sort_keys=False, width=100
        )
        how = "fresh tokens and certificates: keep this output out of version control"
    else:
        body = yaml.dump(render_compose(spec), Dumper=Dumper, sort_keys=False, width=100)
        how = (
            "kvcache deploy secrets --dir deploy/secrets && "
            "docker compose -f deploy/compose.yaml up --build"
        )
    return HEADER.format(what=what, how=how) + body


def configure(parser: argparse.ArgumentParser) -> None:
    d = Spec()
    parser.add_argument(
        "what",
        choices=["k8s", "compose", "secrets"],
        help="which file to render (secrets: a Kubernetes Secret of fresh tokens and "
        "certificates, or with --dir the files the compose file mounts)",
    )
    parser.add_argument("--out", help="write here (default: stdout)")
    parser.add_argument(
        "--dir", help="secrets: write the compose file's secret files into this directory"
    )
    parser.add_argument(
        "--namespace",
        default=d.namespace,
        help="the Kubernetes namespace: the certificate names the pods under it (%(default)s)",
    )
    parser.add_argument("--image", default=d.image, help="the kvcache image (%(default)s)")
    parser.add_argument(
        "--prefill", type=int, default=d.prefill, help="prefill nodes (%(default)s)"
    )
    parser.add_argument("--decode", type=int, default=d.decode, help="decode nodes (%(default)s)")
    parser.add_argument(
        "--conductors", type=int, default=d.conductors, help="conductors, one leads (%(default)s)"
    )
    parser.add_argument(
        "--dram", default=d.dram, help="each node's DRAM tier; sizes /dev/shm (%(default)s)"
    )
    parser.add_argument(
        "--layout",
        default=d.layout,
        help="the one layout the nodes serve (default: the layouts their engines register)",
    )
    parser.add_argument(
        "--drain-bytes",
        default=d.drain_bytes,
        help="a node stopped hands up to this much of its hottest cache to its peers first "
        "('' : not; %(default)s)",
    )
    parser.add_argument(
        "--drain-seconds",
        type=int,
        default=d.drain_seconds,
        help="... within this many seconds (%(default)s)",
    )
    parser.add_argument("--policy", default=d.policy, help="conductor policy (%(default)s)")
    parser.add_argument(
        "--etcd", default="", metavar="URLS", help="an existing etcd (default: deploy one)"
    )
    parser.add_argument("--etcd-prefix", default=d.etcd_prefix, help="(%(default)s)")


def run(args: argparse.Namespace) -> int:
    if args.prefill < 0 or args.decode < 0 or args.prefill + args.decode < 1:
        raise SystemExit("kvcache deploy: --prefill and --decode: at least one node in all")
    if args.conductors < 1:
        raise SystemExit("kvcache deploy: --conductors must be at least 1")
    spec = Spec(
        image=args.image, prefill=args.prefill, decode=args.decode, conductors=args.conductors,
        dram=args.dram, layout=args.layout, policy=args.policy, etcd=args.etcd,
        drain_bytes=args.drain_bytes, drain_seconds=args.drain_seconds,
        etcd_prefix=args.etcd_prefix, namespace=args.namespace,
    )  # fmt: skip
    mib(spec.dram)
    if spec.drain_bytes:
        mib(spec.drain_bytes, "--drain-bytes")
    if not 0 < spec.drain_seconds <= 600:
        raise SystemExit("kvcache deploy: --drain-seconds must be 1 to 600")
    if args.what == "secrets" and args.dir:
        write_secret_files(args.dir, make_secrets(spec))
        print(f"wrote {', '.join(SECRET_FILES)} to {args.dir} (0600: chown them to uid 10001)")
        return 0
    try:
        text = dump(args.what, spec)
    except ModuleNotFoundError as e:
        raise SystemExit(
            f"kvcache deploy needs PyYAML ({e}): pip install 'kvcache[deploy]'"
        ) from None
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0
