"""Node server configuration: CLI flags or a TOML file with the same keys."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, fields

from kvstore.errors import InvalidArgument
from kvstore.layout import KVLayout

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 10**12,
    "tib": 1 << 40,
}

# The demo layout: 1 MiB pages (4 layers x K|V x 256 tokens x 4 heads x 64 dims x fp16).
DEFAULT_LAYOUT = KVLayout(
    model="demo", num_layers=4, kv_heads=4, head_dim=64, dtype="float16", block_tokens=256
)


def parse_size(text: str | int) -> int:
    """``4GiB``, ``512MiB``, ``1.5G``, ``1048576`` -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"cannot parse size {text!r}; use e.g. 4GiB, 512MiB or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_layout(text: str | dict) -> KVLayout:
    """``model=llama,num_layers=32,kv_heads=8,head_dim=128,dtype=bfloat16,block_tokens=256``."""
    if isinstance(text, dict):
        items = dict(text)
    else:
        items = {}
        for part in text.split(","):
            k, sep, v = part.partition("=")
            if not sep:
                raise InvalidArgument(f"layout item {part!r} is not key=value")
            items[k.strip()] = v.strip()
    aliases = {"layers": "num_layers", "heads": "kv_heads", "block": "block_tokens"}
    items = {aliases.get(k, k): v for k, v in items.items()}
    known = {f.name for f in fields(KVLayout)}
    unknown = set(items) - known
    if unknown:
        raise InvalidArgument(f"unknown layout keys {sorted(unknown)}; known: {sorted(known)}")
    for k in ("num_layers", "kv_heads", "head_dim", "block_tokens"):
        if k in items:
            try:
                items[k] = int(items[k])
            except ValueError:
                raise InvalidArgument(f"layout {k} must be an integer, got {items[k]!r}") from None
    missing = {"model", "num_layers", "kv_heads", "head_dim"} - set(items)
    if missing:
        raise InvalidArgument(f"layout is missing {sorted(missing)}")
    return KVLayout(**items)


@dataclass(kw_only=True)
class NodeConfig:
    listen: str = "127.0.0.1:0"
    node_id: str = ""
    # The layouts named at start (--layout): the node serves those only, each with an even
    # split of the budgets. None: it serves the layouts its clients register (RegisterLayout,
    # at most max_layouts; the demo layout from the start), all sharing one DRAM budget and one
    # SSD budget (kvstore/budget.py).
    layouts: list[KVLayout] | None = None
    max_layouts: int = 8
    dram: int = 1 << 30  # bytes: split evenly between --layout layouts, else shared
    gpu: int = 0
    ssd: int = 0
    ssd_dir: str | None = None
    dram_policy: str = "lru"
    ssd_policy: str = "lru"
    gpu_policy: str = "lru"
    promote_on_hit: bool = True
    reserve_shm: bool = True  # allocate the DRAM pool at start (see --no-reserve-shm)
    dram_checksums: bool = True
    ssd_damaged: str = "refuse"  # a damaged SSD lmdb file at start: "refuse" or "move-aside"
    lease_ttl_s: float = 30.0
    # On SIGTERM, hand the hottest blocks to the peers first (node/drain.py); 0: leave at once.
    drain_bytes: int = 0
    drain_seconds: float = 30.0
    write_quarantine_s: float | None = None  # None: 3 x lease_ttl_s (see StoreConfig)
    # Streams hold a gRPC worker each (the pool has WORKERS): caps, and the idle deadline.
    max_streams: int = 16  # Get and Put at once
    max_event_streams: int = 4  # Events feeds at once
    stream_idle_timeout_s: float = 30.0
    # What one tenant may hold (node/quotas.py); the admin is not limited.
    max_streams_per_tenant: int | None = None  # None: half of max_streams
    tenant_lease_share: float = 0.5
    tenant_max_leases: int = 1024
    tenant_lease_lifetime_s: float = 600.0
    token: str | None = None
    service_token: str | None = None  # the conductor's feeds: Events only (rpc.server.SERVICE)
    tenant_tokens: list[str] = field(default_factory=list)
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    max_keys_per_request: int = 65536
    # registration with a conductor (optional)
    conductor: str | None = None
    conductor_token: str | None = None
    conductor_tls_ca: str | None = None  # CA (PEM) to verify a conductor serving TLS
    role: str = "both"
    messenger: str = ""
    advertise: str | None = None  # address others use to reach this node (default: listen)
    # registration in etcd instead (plumbing/registration.py): endpoints, key prefix, lease TTL
    etcd: str | None = None
    etcd_prefix: str = "/kvcache"
    etcd_ttl_s: int = 5
    etcd_ca: str | None = None  # https:// etcd: its CA, and this node's client certificate
    etcd_cert: str | None = None
    etcd_key: str | None = None

    @property
    def fixed_layouts(self) -> bool:
        """The node serves the layouts it was started with, and registers none at run time."""
        return self.layouts is not None

    @property
    def start_layouts(self) -> list[KVLayout]:
        return [DEFAULT_LAYOUT] if self.layouts is None else self.layouts

    def pages(self, layout: KVLayout) -> tuple[int, int, int]:
        """(gpu, dram, ssd) pages for one layout: with --layout, each budget split evenly
        between them; else the most the shared budgets hold in this layout."""
        n = len(self.layouts) if self.layouts is not None else 1
        per = lambda total: total // n // layout.page_bytes  # noqa: E731
        return per(self.gpu), per(self.dram), per(self.ssd)


def load_toml(path: str) -> dict:
    """Read a node TOML file: top-level keys as the CLI flags (dashes or underscores), layouts
    as ``[[layout]]`` tables."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    out = {k.replace("-", "_"): v for k, v in data.items() if k != "layout"}
    if "layout" in data:
        out["layouts"] = [parse_layout(t) for t in data["layout"]]
    return out
