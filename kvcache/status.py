"""``kvcache status``: a running cluster at a glance, as tables for people or JSON for scripts.

    kvcache status                      # the cluster 'kvcache up' started (its cluster.json)
    kvcache status --conductor HOST:PORT --token-file T
    kvcache status --json | jq '.nodes[] | {id, hit_rate}'
    kvcache status --watch              # refreshed every --interval seconds; Ctrl-C stops

Rates (decisions/s, GB/s) are the counters' growth over ``--interval`` (two readings). Exit code:
0 when every process serves, 1 when one does not (or a node is not registered), 2 when there is
no cluster to ask. The gathering is ``clients.cluster_status``; this module only shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from rpc.server import address_arg

from .cluster_access import NoCluster, add_access_args, read_cluster


def configure(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--conductor",
        type=address_arg,
        help="ask this conductor (and the nodes it lists) instead of a cluster.json",
    )
    add_access_args(parser, where)
    parser.add_argument("--json", action="store_true", help="JSON (one document per reading)")
    parser.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between the two readings that rates come from, and between refreshes "
        "(default: %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per RPC")


class StatusError(Exception):
    """No cluster to ask; the message says how to name one."""


def _targets(args: argparse.Namespace) -> tuple[str | None, list[Any], str | None, str | None]:
    """(conductor address, nodes from cluster.json, token, TLS CA)."""
    from clients.cluster_status import Target

    if args.conductor:
        return args.conductor, [], args.token, args.tls_ca
    try:
        info, _ = read_cluster(args)
    except NoCluster as e:
        raise StatusError(
            str(e) if e.config else f"{e}, or name a conductor with --conductor HOST:PORT"
        ) from None
    nodes = [Target(n.id, n.role, n.address, n.messenger) for n in info.nodes]
    # NOTE: every conductor of an etcd cluster: the client moves on from one that is down
    conductor = ",".join(info.conductors) or info.conductor
    return conductor, nodes, args.token or info.token, args.tls_ca or info.tls_ca


def run(args: argparse.Namespace) -> int:
    if not 0 < args.interval <= 3600 or not 0 < args.timeout <= 600:
        print("kvcache status: --interval and --timeout must be positive seconds", file=sys.stderr)
        return 2
    try:
        conductor, nodes, token, tls_ca = _targets(args)
    except StatusError as e:
        print(f"kvcache status: {e}", file=sys.stderr)
        return 2
    from clients.cluster_status import StatusReader, with_rates

    with StatusReader(conductor, nodes, token, tls_ca, args.timeout) as reader:
        before = reader.read()
        time.sleep(args.interval)
        status = with_rates(before, reader.read())
        if not args.watch:
            show(status, args.json)
            return 1 if status.problems() else 0
        return _watch(reader, status, args)


def _watch(reader: Any, status: Any, args: argparse.Namespace) -> int:
    from clients.cluster_status import with_rates

    try:
        if args.json:
            while True:
                show(status, True)
                sys.stdout.flush()
                time.sleep(args.interval)
                status = with_rates(status, reader.read())
        from rich.live import Live

        with Live(render(status), auto_refresh=False) as live:
            while True:
                time.sleep(args.interval)
                status = with_rates(status, reader.read())
                live.update(render(status), refresh=True)
    except KeyboardInterrupt:
        return 0


def show(status: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(status.to_dict(), separators=(",", ":")))
        return
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = 110  # a file or a pipe: room for every column
    console.print(render(status))


# ---- rendering --------------------------------------------------------------------------------


def _ok(health: str) -> str:
    return f"[green]{health}[/]" if health == "SERVING" else f"[bold red]{health or '?'}[/]"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _rate(x: float | None, unit: str) -> str:
    return "-" if x is None else f"{x:.2f} {unit}"


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _fill(t: Any) -> str:
    return f"{_pct(t.fill)} {t.used_pages:,}/{t.capacity_pages:,}"


def render(status: Any) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    c = status.conductor
    if c is not None:
        line = f"conductor {c.address} {_ok(c.health)}"
        if not c.error:
            line += (
                f"  leader {c.leader}  policy {c.policy}  up {_duration(c.uptime_s)}\n"
                f"  {_rate(c.decisions_per_s, 'decisions/s')}  {c.decisions:,} placed, "
                f"{c.rejections:,} rejected since start, {c.pending_requests:,} pending; "
                f"{c.registered_nodes} nodes registered, {c.indexed_keys:,} keys indexed"
            )
        else:
            line += f"  [red]{c.error}[/]"
        parts.append(Text.from_markup(line))
    nodes = Table(title="nodes", title_justify="left")
    nodes.add_column("node / address", no_wrap=True)
    nodes.add_column("role", no_wrap=True)
    nodes.add_column("health", no_wrap=True)
    nodes.add_column("layout", no_wrap=True)
    held = {t.tier for n in status.nodes for lay in n.layouts for t in lay.tiers}
    tier_cols = [t for t in ("gpu", "dram", "ssd") if t in held] or ["dram"]
    for col in [f"{t.upper()} fill" for t in tier_cols] + ["pinned", "hit rate", "queue"]:
        nodes.add_column(col, justify="right", no_wrap=True)
    nodes.add_column("decoding", justify="right", no_wrap=True)
    for n in status.nodes:
        health = _ok(n.health)
        if n.health == "SERVING" and status.conductor is not None and not n.registered:
            health += "\n[red]unregistered[/]"
        load = (f"{n.queue_s:.2f} s", f"{n.decode_requests}") if n.registered else ("-", "-")
        layouts = n.layouts or [None]
        for i, lay in enumerate(layouts):
            tiers = {t.tier: t for t in lay.tiers} if lay is not None else {}
            first = i == 0
            nodes.add_row(
                f"{n.id}\n{n.address}" if first else "",
                n.role if first else "",
                Text.from_markup(health) if first else "",
                lay.namespace.split("|", 1)[0] if lay is not None else (n.error or "-"),
                *(_fill(tiers[t]) if t in tiers else "-" for t in tier_cols),
                f"{sum(t.pinned_pages for t in tiers.values()):,}" if lay is not None else "-",
                _pct(lay.hit_rate) if lay is not None else "-",
                *(load if first else ("", "")),
            )
    parts.append(nodes)
    if any(n.tenants for n in status.nodes):
        ts = Table(title="tenants", title_justify="left")
        ts.add_column("node", no_wrap=True)
        ts.add_column("tenant", no_wrap=True)
        for col in ("leases", "leased pages", "blocks", "streams"):
            ts.add_column(col, justify="right", no_wrap=True)
        for n in status.nodes:
            for i, t in enumerate(n.tenants):
                ts.add_row(
                    n.id if i == 0 else "",
                    t.tenant or "(admin)",
                    f"{t.leases:,}",
                    f"{t.leased_pages:,}",
                    f"{t.stored_blocks:,}",
                    f"{t.streams:,}",
                )
        parts.append(ts)
    if any(n.messenger is not None for n in status.nodes):
        ms = Table(title="messengers", title_justify="left")
        for col in ("node / messenger", "health", "transport", "in flight"):
            ms.add_column(col, no_wrap=True)
        for col in ("recv", "sent", "received", "sent total"):
            ms.add_column(col, justify="right", no_wrap=True)
        for n in status.nodes:
            m = n.messenger
            if m is None:
                continue
            ms.add_row(
                f"{n.id}\n{m.address}",
                Text.from_markup(_ok(m.health) + (f"\n[red]{m.error}[/]" if m.error else "")),
                m.transport or "-",
                f"{m.batches_in_flight} batches\n{m.entries_in_flight} keys",
                _rate(m.recv_gbps, "GB/s"),
                _rate(m.sent_gbps, "GB/s"),
                _bytes(m.bytes_received),
                _bytes(m.bytes_sent),
            )
        parts.append(ms)
    problems = status.problems()
    if problems:
        parts.append(Text.from_markup("\n".join(f"[bold red]![/] {p}" for p in problems)))
    return Group(*parts)
