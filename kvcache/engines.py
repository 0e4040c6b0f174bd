"""Engines and the router in a ``kvcache up`` cluster: real vLLM servers beside their nodes.

    [engine_defaults]                     # shared by every [[engines]] entry
    model = "../out/serve/tiny-llama"     # a model directory (relative: to the config file)
    served_model_name = "tiny-llama"
    args = ["--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", "67108864"]
    env = ["VLLM_CPU_OMP_THREADS_BIND=0"]
    pool = true                           # load prefixes cached on any node (default: false)

    [[engines]]
    node = "prefill-0"                    # the node it stores to and loads from
    kv_role = "both"                      # producer | consumer | both (default: by node role)

    [router]                              # `kvcache router` in front of the engines
    listen = "127.0.0.1:8000"             # (empty, the default: no router)
    mode = "aggregated"                   # one engine per request (nodes of role both); the
                                          # default, disaggregated: prefill then decode engines
    disaggregate_above = 512              # aggregated, but longer uncached suffixes go
                                          # disaggregated (0, the default: never)

The keys and their types are in ``cluster_config``'s schema.

Each engine is vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``; vLLM's
``vllm serve`` command) with our connector (``clients.vllm_connector``) pointed at its node, the
node's layout model and block size, and the cluster's token and CA. ``kv_role``: a prefill node's
engine defaults to ``both`` (it loads cached prefixes and stores what it computes), a decode
node's to ``consumer`` (it only loads). Engines start once every node serves, all at once; the
launcher waits for each one's ``/health`` (a real readiness probe, with a deadline), then starts
the router. The conductor gets ``--engine-metrics`` for every engine (ports are chosen up front),
so it learns engine load from the engines themselves. Engines run in their own process group
(vLLM's API server, engine core and worker processes), stopped together: router first, then engines,
then the rest of the cluster.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable

from kvstore.errors import KVStoreError
from node.config import parse_layout
from plumbing.launch import (
    PortReservation,
    ServiceProcess,
    child_environ,
    group_shm,
    release_shm,
    start_service,
)

from .cluster_config import ClusterConfig, ConfigError

KV_ROLES = {"producer": "kv_producer", "consumer": "kv_consumer", "both": "kv_both"}
DEFAULT_KV_ROLE = {"prefill": "both", "decode": "consumer", "both": "both"}


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    node: str
    model: str
    served_model_name: str
    kv_role: str  # producer | consumer | both
    port: int = 0  # 0: a free one
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    pool: bool = False  # loads from any node (the connector's 'conductor')
    block_tokens: int = 0  # its pages' tokens on a node without a layout (0: the connector's)


def kv_transfer_config(
    spec: EngineSpec,
    node: dict[str, Any],
    token_file: str | None,
    tls_ca: str | None,
    conductor: str = "",
) -> dict[str, Any]:
    """The engine's ``--kv-transfer-config``: our connector on its node, the node layout's model
    and block size (a node without one: the connector registers its model's), the cluster's
    token and CA, and with ``pool`` the conductor."""
    extra: dict[str, Any] = {"node": node["address"]}
    if node["layout"]:  # else the connector registers its model's (served name, 256 tokens)
        try:
            layout = parse_layout(node["layout"])
        except KVStoreError as e:
            raise ConfigError(f"node {spec.node}: {e}") from None
        extra.update(model=layout.model, block_tokens=layout.block_tokens)
    elif spec.block_tokens:
        extra["block_tokens"] = spec.block_tokens
    if token_file:
        extra["token_file"] = token_file
    if tls_ca:
        extra["tls_ca_file"] = tls_ca
    if spec.pool and conductor:
        extra["conductor"] = conductor  # its node's messenger: the one it registered
    return {
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "clients.vllm_connector",
        "kv_role": KV_ROLES[spec.kv_role],
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


@dataclass(frozen=True, kw_only=True)
class ServingConfig:
    engines: tuple[EngineSpec, ...]
    router_listen: str | None = None  # None: no router
    router_args: tuple[str, ...] = ()  # the [router] settings as flags, then its args
    start_timeout_s: float = 300.0


def serving_config(cfg: ClusterConfig) -> ServingConfig | None:
    """The ``[[engines]]`` of a cluster config with ``[engine_defaults]`` filled in, and its
    ``[router]``; None without engines. ``ConfigError`` naming what to fix (the keys and types
    themselves are checked by the schema, ``cluster_config``)."""
    rows = cfg.tables.get("engines", [])
    defaults = cfg.settings.get("engine_defaults", {})
    router = cfg.settings.get("router", {})
    where = cfg.path or "the config"
    if not rows:
        if router.get("listen"):
            raise ConfigError(f"{where}: [router] listen needs [[engines]] to route to")
        return None
    roles = {n.id: n.role for n in cfg.nodes}
    base = os.path.dirname(os.path.abspath(cfg.path)) if cfg.path else os.getcwd()
    specs = []
    for i, row in enumerate(rows):
        at = f"{where}: [[engines]] #{i + 1} (node {row['node']!r})"
        if row["node"] not in roles:
            raise ConfigError(f"{at}: not a [[node]] id ({', '.join(roles)})")
        value = {k: defaults.get(k) if row.get(k) is None else row[k] for k in defaults}
        model = value["model"]
        if not model:
            raise ConfigError(f"{at}: no model (a model directory, in it or [engine_defaults])")
        from_file = (
            row.get("model") is not None or cfg.sources.get("engine_defaults.model") == cfg.path
        )
        if not os.path.isabs(model) and from_file:  # relative to the file, as state_dir is
            model = os.path.normpath(os.path.join(base, model))
        env = []
        for item in value["env"]:
            name, sep, val = item.partition("=")
            if not sep or not name:
                raise ConfigError(f"{at}: env entries are NAME=VALUE, got {item!r}")
            env.append((name, val))
        specs.append(
            EngineSpec(
                node=row["node"],
                model=model,
                served_model_name=value["served_model_name"] or os.path.basename(model.rstrip("/")),
                kv_role=value["kv_role"] or DEFAULT_KV_ROLE[roles[row["node"]]],
                port=row["port"],
                args=tuple(value["args"]),
                env=tuple(env),
                pool=bool(value["pool"]),
                block_tokens=int(value["block_tokens"] or 0),
            )
        )
    nodes = [s.node for s in specs]
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{where}: one [[engines]] entry per node ({', '.join(nodes)})")
    if len({s.served_model_name for s in specs}) != 1:
        raise ConfigError(f"{where}: every engine must serve the same served_model_name")
    flags = []
    if router["mode"] == "aggregated":
        if not any(roles[s.node] == "both" for s in specs):
            raise ConfigError(
                f'{where}: [router] mode = "aggregated" needs an engine on a [[node]] of role '
                '"both" (one node prefills and decodes each request)'
            )
        flags += ["--mode", "aggregated"]
    if router["disaggregate_above"]:
        if router["mode"] != "aggregated" or router["disaggregate_above"] < 0:
            raise ConfigError(
                f'{where}: [router] disaggregate_above needs mode = "aggregated" and a '
                "number of tokens >= 0"
            )
        flags += ["--disaggregate-above", str(router["disaggregate_above"])]
    if not defaults["start_timeout_s"] > 0:
        raise ConfigError(f"{where}: [engine_defaults] start_timeout_s must be positive")
    return ServingConfig(
        engines=tuple(specs),
        router_listen=router["listen"] or None,
        router_args=(*flags, *router["args"]),
        start_timeout_s=float(defaults["start_timeout_s"]),
    )


@dataclass
class EngineProcess:
    """A running vLLM server (the leader of its own process group)."""

    spec: EngineSpec
    url: str
    proc: subprocess.Popen[bytes]
    log_path: str
    # The /dev/shm segments its processes held once it was healthy: removed after a crash too.
    seen_shm: set[str] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, http.client.HTTPException):  # not vLLM (yet) on that port
            return False

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def signal(self, signum: int) -> None:
        try:
            os.killpg(self.proc.pid, signum)  # the API server and its engine-core process
        except ProcessLookupError:
            pass

    def shm(self) -> tuple[set[int], set[str]]:
        """The engine's processes and the /dev/shm segments they hold (vLLM's ``psm_*``),
        with those seen before."""
        pids, names = group_shm(self.proc.pid)
        self.seen_shm |= names
        return pids, set(self.seen_shm)

    def kill(self) -> list[str]:
        """SIGKILL the engine's processes, as a crash would, then remove the shared memory
        its processes held: they cannot unlink it themselves, and vLLM's segments are hundreds
        of MB each. Stopped first, so that nothing is made or handed on between the reading
        and the kill. Python's multiprocessing resource tracker is spared: it unlinks the
        semaphores the others registered (``sem.mp-*``) once they are gone, and exits; what
        it leaves (killed in its turn, or late) is removed here. Returns the segments removed."""
        self.signal(signal.SIGSTOP)
        pids, names = self.shm()
        trackers = {p for p in pids if _is_resource_tracker(p)}
        for pid in pids - trackers:
            _signal_pid(pid, signal.SIGKILL)
        for pid in trackers:
            _signal_pid(pid, signal.SIGCONT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return release_shm(pids, names)  # waits for the trackers too (their unlinks)


@dataclass(frozen=True)
class EngineSite:
    """Where an engine runs on a namespaced host (``kvcache up --hosts``): beside its node,
    in the host's network namespace (``wrap``), serving on the host's address."""

    wrap: list[str]
    ip: str
    port: int


@dataclass
class Serving:
    """The engines (and router) of one cluster: ports first, processes once the nodes serve."""

    config: ServingConfig
    host: str
    engines: list[EngineProcess] = field(default_factory=list)
    router: ServiceProcess | None = None
    ports: dict[str, int] = field(default_factory=dict)
    # Picked ports held until their engine serves: another service of this host starting
    # meanwhile (vLLM takes a minute or more to bind) must not pick them too.
    held: dict[str, PortReservation] = field(default_factory=dict)
    sites: dict[str, EngineSite] = field(default_factory=dict)  # by node: on namespaced hosts

    def plan(
        self,
        reserve: Callable[[str], PortReservation],
        sites: dict[str, EngineSite] | None = None,
    ) -> list[str]:
        """Pick every engine's port (``sites``: the hosts' fixed ones, where engines run in
        network namespaces); the conductor's ``--engine-metrics`` flags for them."""
        self.sites = dict(sites or {})
        self.held = {
            s.node: reserve(self.host)
            for s in self.config.engines
            if not s.port and s.node not in self.sites
        }
        self.ports = {
            s.node: s.port
            or (self.sites[s.node].port if s.node in self.sites else self.held[s.node].port)
            for s in self.config.engines
        }
        flags = []
        for node, port in self.ports.items():
            flags += ["--engine-metrics", f"http://{self.host_of(node)}:{port}/metrics={node}"]
        return flags

    def host_of(self, node: str) -> str:
        site = self.sites.get(node)
        return site.ip if site is not None else self.host

    def start(
        self,
        nodes: dict[str, dict[str, Any]],
        log_dir: str,
        conductor: str,
        token_file: str | None,
        tls_ca: str | None,
        detach: bool,
    ) -> dict[str, Any]:
        """Start every engine beside its node (``nodes``: id -> the state ``kvcache up``
        records: address, layout), wait until all are healthy, then the router. Returns what
        goes into cluster.json."""
        for spec in self.config.engines:
            self.engines.append(
                self._launch(spec, nodes[spec.node], log_dir, token_file, tls_ca, conductor, detach)
            )
        deadline = time.monotonic() + self.config.start_timeout_s
        for engine in self.engines:
            _wait_healthy(engine, deadline, self.config.start_timeout_s)
            self._release(engine.spec.node)
            engine.shm()
        # Nodes without a layout serve what their engines registered: the router (which finds
        # the namespace through the conductor) starts once the conductor lists them.
        unnamed = {s.node for s in self.config.engines if not nodes[s.node]["layout"]}
        if unnamed:
            model = self.config.engines[0].served_model_name  # one for all (checked)
            _wait_layouts(conductor, unnamed, model, token_file, tls_ca, deadline)
        state: dict[str, Any] = {
            "engines": [
                {
                    "node": e.spec.node,
                    "url": e.url,
                    "pid": e.pid,
                    "log": e.log_path,
                    "shm": sorted(e.seen_shm),
                    "kv_role": e.spec.kv_role,
                    "model": e.spec.served_model_name,
                }
                for e in self.engines
            ]
        }
        if self.config.router_listen is not None:
            args = ["router", "--listen", self.config.router_listen, "--conductor", conductor]
            for e in self.engines:
                args += ["--engine", f"{e.spec.node}={e.url}"]
            if token_file:
                args += ["--token-file", token_file]
            if tls_ca:
                args += ["--tls-ca", tls_ca]
            self.router = start_service(
                [*args, *self.config.router_args],
                timeout_s=60,
                log_dir=log_dir,
                new_session=detach,
            )
            state["router"] = {
                "address": self.router.address,
                "url": f"http://{self.router.address}",
                "pid": self.router.pid,
                "log": self.router.log_path,
            }
        return state

    def _launch(
        self,
        spec: EngineSpec,
        node: dict[str, Any],
        log_dir: str,
        token_file: str | None,
        tls_ca: str | None,
        conductor: str = "",
        detach: bool = False,
    ) -> EngineProcess:
        transfer = kv_transfer_config(spec, node, token_file, tls_ca, conductor)
        port, host = self.ports[spec.node], self.host_of(spec.node)
        site = self.sites.get(spec.node)
        cmd = [
            *(site.wrap if site is not None else []),  # ip netns exec HOST: same pid
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            spec.model,
            "--served-model-name",
            spec.served_model_name,
            "--host",
            host,
            "--port",
            str(port),
            # the router reads how much of a prompt the prefill engine found cached
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(transfer),
            *spec.args,
        ]
        log_path = os.path.join(log_dir, f"engine-{spec.node}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**child_environ(), **dict(spec.env)},
                # Its own process group: stopped (or killed) with its children. Detached, a
                # session of its own too (it outlives this terminal); in the foreground it stays
                # in the cluster's session: a session is a scheduling group of its own where
                # the kernel groups by session (sched_autogroup), and a TP engine's ranks,
                # spinning pinned one per core, then starved the nodes and messengers of the
                # other group for seconds on a 2-core host (the test harness's TP=2 pool test).
                start_new_session=detach,
                process_group=None if detach else 0,
            )
        return EngineProcess(spec, f"http://{host}:{port}", proc, log_path)

    def _release(self, node: str) -> None:
        reservation = self.held.pop(node, None)
        if reservation is not None:
            reservation.release()

    def stop(self, timeout_s: float = 15.0) -> list[int]:
        """The router, then every engine (SIGTERM to each group at once, SIGKILL after
        ``timeout_s``); returns exit codes."""
        codes = []
        for node in list(self.held):
            self._release(node)
        if self.router is not None:
            codes.append(self.router.stop(timeout_s))
            self.router = None
        pids, names = set[int](), set[str]()
        for e in self.engines:
            held = e.shm()
            pids |= held[0]
            names |= held[1]
        for e in self.engines:
            e.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for e in self.engines:
            try:
                e.proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                # NOTE: read again what its processes hold now: segments made while it was
                # shutting down would otherwise be left behind by the SIGKILL.
                pids |= e.shm()[0]
                names |= e.seen_shm
                e.signal(signal.SIGKILL)
                e.proc.wait(5)
            held = e.shm()  # an engine-core child the server left behind, and what it holds
            pids |= held[0]
            names |= held[1]
            e.signal(signal.SIGKILL)
            codes.append(e.proc.returncode)
        self.engines.clear()
        release_shm(pids, names)  # what engines that needed SIGKILL could not unlink
        return codes


def _is_resource_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def _signal_pid(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _wait_layouts(
    conductor: str,
    nodes: set[str],
    model: str,
    token_file: str | None,
    tls_ca: str | None,
    deadline: float,
) -> None:
    """Until the conductor lists, for each of ``nodes``, a layout of ``model`` (their engines'
    connectors registered it at start; the node's agent tells the conductor; the router routes
    on the namespace of the model its engines serve)."""
    from clients.conductor_client import ConductorClient
    from rpc.wire import layout_from_pb

    token = None
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    with ConductorClient(conductor, token, tls_ca) as c:
        while True:
            served = {
                s.node.node_id
                for s in c.list_nodes().nodes
                for layout in map(layout_from_pb, s.node.layouts)
                if layout.model == model
            }
            if nodes <= served:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the conductor lists no layout of {model!r} for node(s) "
                    f"{sorted(nodes - served)} after their engines started: their connectors "
                    "registered none (see the engines' logs), or the nodes did not tell the "
                    "conductor"
                )
            time.sleep(0.2)  # another process registers it; no event to wait on


def _wait_healthy(engine: EngineProcess, deadline: float, timeout_s: float) -> None:
    """Poll the engine's ``/health`` until it answers 200; a clear error with its log's tail
    if it exits first or the deadline passes."""
    delay = 0.1
    while not engine.healthy():
        if not engine.alive():
            raise RuntimeError(
                f"the vLLM engine of {engine.spec.node} exited with code "
                f"{engine.proc.returncode} before it was healthy; {engine.log_path}:\n"
                f"{engine.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the vLLM engine of {engine.spec.node} at {engine.url} not healthy after "
                f"{timeout_s:g} s (engine_defaults.start_timeout_s); {engine.log_path}:\n"
                f"{engine.log_tail()}"
            )
        time.sleep(delay)  # an HTTP probe of another process; vLLM prints no ready line
        delay = min(delay * 2, 1.0)
