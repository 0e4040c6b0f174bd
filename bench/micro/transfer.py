"""``kvcache bench transfer``: messenger TCP transfer throughput against references run alongside.

For each page size, ``--total`` bytes move from a source process to a destination, these ways:

- **raw**: the reference. A plain two-process Python socket copy: the child ``sendall``s
  page-sized memoryview slices of a prefaulted buffer, this process ``recv_into``s a
  preallocated buffer (the shape of ``shared/peers/baseline_bench.py``, in the pull direction).
- **messenger tcp xN**: the TCP transport alone. The child is ``python -m messenger.slab_peer``
  (a ``DataServer`` over a shared-memory slab of pages); this process calls
  ``TcpTransport.fetch`` for every page's key into page views of its own shared-memory slab:
  request framing, N lanes, pipelining and xxh3 checksums on both sides included.
- **messenger tls xN** (``--no-tls`` skips it): the same over TLS, as the data ports of a
  ``--tls`` cluster speak it (a second slab peer with a local CA's certificate; this process
  verifies it): the cost of encrypting the data port, measured in the same run.
- **node+messenger** (the figure that counts; ``--no-e2e`` skips it): two real node and
  messenger process pairs; one ``SubmitTransfer`` of every page to the destination's messenger,
  timed from the submit to the finished status, so the destination node's Allocate and Commit,
  the source node's Acquire and Release and the messengers' work are all in it.
- **mooncake**: Mooncake's Transfer Engine over TCP, batch read (a pull) of the same bytes in
  blocks of the page size (``bench/micro/mooncake_rounds.py`` drives ``shared/peers``'
  ``mooncake_te_bench.py``), when a Python with ``mooncake-transfer-engine-non-cuda`` is
  available (``--mooncake-python``); skipped with a message otherwise.

Every method's rounds alternate (raw, x1, x2, node+messenger, Mooncake, raw, ...), so load from
elsewhere on the machine hits them alike; median of ``--runs`` timed rounds after one warm-up;
GB/s = 1e9 bytes/s. Every row is printed as a ratio to the raw socket and to Mooncake's batch
read of the same run, and the node+messenger row against the goals (>= 0.9x raw, >= 1.3x
Mooncake).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import Column, human, parse_bytes, plot_bars, print_table, write_json
from kvstore.shm import SharedSlab, unique_shm_name
from rpc.tls import TlsFiles, make_local_ca

from .transfer_rig import (
    MIB,
    ROOT,
    Measurement,
    NodePair,
    RawReference,
    e2e_layout_spec,
    raw_sender,
)

DEFAULT_PEERS = ROOT.parent / "shared" / "peers"
DEFAULT_MC_PYTHON = "/tmp/mc-venv/bin/python"
E2E_METHOD = "node+messenger x{lanes}"
MOONCAKE_METHOD = "mooncake TE batch read"
GOAL_VS_RAW = 0.9  # issue 16: the node+messenger pull against the raw socket copy
GOAL_VS_MOONCAKE = 1.3  # ... and against Mooncake's Transfer Engine over TCP


# ---- the messenger's TCP transport ------------------------------------------------------------


class MessengerSide:
    """A slab peer (source process) and this process's destination slab for one page size."""

    def __init__(
        self, total: int, page_bytes: int, request_bytes: int, tls: TlsFiles | None = None
    ) -> None:
        from messenger.slab_peer import NAMESPACE, pattern_keys

        self.n = total // page_bytes
        self.page_bytes, self.request_bytes = page_bytes, request_bytes
        self.namespace = NAMESPACE
        self.tls = tls
        self.children: list[subprocess.Popen] = []
        self.slab = SharedSlab.create(unique_shm_name("bench-dst"), self.n * page_bytes)
        self.transports: dict = {}
        self.address = self._start_peer([])
        self.tls_address = (
            self._start_peer(["--tls-cert", tls.cert, "--tls-key", tls.key]) if tls else None
        )
        self.pages = self.slab.array.reshape(self.n, page_bytes)
        self.pages[:] = 0  # prefault, as the raw reference's buffer is
        self.keys = pattern_keys(self.n)
        self.views = [memoryview(self.pages[i]) for i in range(self.n)]

    def _start_peer(self, extra: list[str]) -> str:
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "messenger.slab_peer",
                "--pages",
                str(self.n),
                "--page-bytes",
                str(self.page_bytes),
                *extra,
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.children.append(child)
        line = child.stdout.readline()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"slab peer did not start: {line!r}")
        return str(json.loads(line[6:])["address"])

    def round(self, lanes: int, tls: bool = False) -> float:
        from messenger.data_security import client_context
        from messenger.tcp import TcpConfig, TcpTransport

        transport = self.transports.get((lanes, tls))
        if transport is None:
            context = client_context(self.tls.ca_cert) if tls and self.tls else None
            transport = TcpTransport(
                TcpConfig(lanes=lanes, request_bytes=self.request_bytes, tls=context)
            )
            self.transports[(lanes, tls)] = transport
        address = self.tls_address if tls else self.address
        t0 = time.perf_counter()
        results = transport.fetch(address, self.namespace, self.keys, self.views)
        dt = time.perf_counter() - t0
        failed = [res for res in results if not res.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} pages failed: {failed[0].reason}")
        return dt

    def verify(self) -> bool:
        from messenger.slab_peer import fill_pattern

        expected = np.empty((min(self.n, 64), self.page_bytes), dtype=np.uint8)
        fill_pattern(expected)
        return bool(np.array_equal(self.pages[: len(expected)], expected))

    def close(self) -> None:
        for t in self.transports.values():
            t.close()
        for child in self.children:
            child.stdin.close()
            child.wait(timeout=60)
        self.views = self.pages = None
        self.slab.close()
        self.slab.unlink()


# ---- Mooncake Transfer Engine -----------------------------------------------------------------


class MooncakeSide:
    """Mooncake's Transfer Engine over TCP, a round at a time: ``bench/micro/mooncake_rounds.py``
    run by a Python that has ``mooncake-transfer-engine-non-cuda``; ``round`` is one batch read (a
    pull) of ``total`` bytes in blocks of ``page_bytes``."""

    def __init__(self, python: str, peers: Path, total: int, log_path: str) -> None:
        self.child = subprocess.Popen(
            [
                python,
                str(ROOT / "bench" / "micro" / "mooncake_rounds.py"),
                "--peers",
                str(peers),
                "--total",
                str(total),
                "--child-log",
                log_path,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self._line("READY", 120)
        self.isolated = bool(json.loads(line)["isolated_netns"])
        self.verified: bool | None = None

    def _line(self, tag: str, timeout_s: float) -> str:
        assert self.child.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.child.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise RuntimeError(f"Mooncake TE: no {tag} within {timeout_s:g} s")
        line = self.child.stdout.readline()
        if not line.startswith(tag + " "):
            raise RuntimeError(f"Mooncake TE: expected {tag}, got {line.strip()!r}")
        return line[len(tag) + 1 :]

    def round(self, page_bytes: int) -> float:
        assert self.child.stdin is not None
        self.child.stdin.write(f"read {page_bytes}\n")
        self.child.stdin.flush()
        return float(self._line("SECONDS", 600))

    def close(self) -> None:
        try:
            if self.child.stdin is not None and not self.child.stdin.closed:
                self.child.stdin.close()
                self.verified = self._line("VERIFY", 300).strip() == "OK"
        except (OSError, RuntimeError):
            self.verified = False
        finally:
            try:
                self.child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.child.kill()  # our own child, by handle
                self.child.wait()


def start_mooncake(
    python: str, peers: Path, total: int, log_path: str
) -> tuple[MooncakeSide | None, str]:
    """The Mooncake side, or None and why it is skipped."""
    script = peers / "mooncake_te_bench.py"
    if not (os.path.exists(python) and script.exists()):
        return None, (
            f"Mooncake TE skipped: need {python} with mooncake-transfer-engine-non-cuda "
            f"(python -m venv /tmp/mc-venv && /tmp/mc-venv/bin/pip install "
            f"mooncake-transfer-engine-non-cuda numpy) and {script}"
        )
    check = subprocess.run([python, "-c", "import mooncake.engine"], capture_output=True)
    if check.returncode:
        return None, f"Mooncake TE skipped: {python} cannot import mooncake.engine"
    try:
        side = MooncakeSide(python, peers, total, log_path)
    except (OSError, RuntimeError) as e:
        tail = Path(log_path).read_text(errors="replace")[-600:] if Path(log_path).exists() else ""
        return None, f"Mooncake TE failed to start ({e}): {tail}"
    where = "private loopback netns" if side.isolated else "host network"
    return side, f"Mooncake TE over TCP ({where}), batch read rounds interleaved with ours"


# ---- one page size ---------------------------------------------------------------------------


def bench_size(
    total: int,
    page_bytes: int,
    runs: int,
    lanes_list: list[int],
    request_bytes: int,
    e2e_lanes: int | None,
    mooncake: MooncakeSide | None,
    tls: TlsFiles | None = None,
) -> list[Measurement]:
    """Every method's rounds interleaved (raw, x1, x2, tls x1, tls x2, e2e, Mooncake, raw, ...)
    so that load from elsewhere on the machine hits every method alike; the first round of
    each is a warm-up."""
    raw = RawReference(total, page_bytes, runs + 1)
    sides: list = []
    try:
        side = MessengerSide(total, page_bytes, request_bytes, tls)
        sides.append(side)
        e2e = NodePair(total, page_bytes, e2e_lanes) if e2e_lanes else None
        if e2e is not None:
            sides.append(e2e)
        out = [Measurement("raw socket", page_bytes, total)]
        rounds: list = [raw.round]
        for lanes in lanes_list:
            out.append(Measurement(f"messenger tcp x{lanes}", page_bytes, total, note="verified"))
            rounds.append(lambda lanes=lanes: side.round(lanes))
        for lanes in lanes_list if tls else []:
            out.append(Measurement(f"messenger tls x{lanes}", page_bytes, total, note="verified"))
            rounds.append(lambda lanes=lanes: side.round(lanes, tls=True))
        if e2e is not None:
            out.append(Measurement(E2E_METHOD.format(lanes=e2e_lanes), page_bytes, total))
            rounds.append(e2e.round)
        if mooncake is not None:
            out.append(Measurement(MOONCAKE_METHOD, page_bytes, total))
            rounds.append(lambda: mooncake.round(page_bytes))
        for r in range(runs + 1):
            for m, one_round in zip(out, rounds):
                t = one_round()
                if r:
                    m.runs_s.append(t)
        if not side.verify():
            raise RuntimeError("messenger transfer delivered wrong bytes")
        if e2e is not None:
            if not e2e.pull.verify():
                raise RuntimeError("messenger pull between nodes delivered wrong bytes")
            next(m for m in out if m.method.startswith("node+")).note = "verified"
    finally:
        raw.close()
        for s in reversed(sides):
            s.close()
    return out


# ---- command -----------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--total",
        type=parse_bytes,
        default=512 << 20,
        help="bytes moved per round and page size (default 512M; e.g. 128M quick)",
    )
    parser.add_argument("--sizes", default="1M,4M", help="page sizes (default 1M,4M)")
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (median reported)")
    parser.add_argument("--lanes", default="1,2", help="messenger TCP lanes; a list compares")
    parser.add_argument(
        "--request-bytes",
        type=parse_bytes,
        default=64 << 20,
        help="bytes of pages per messenger request (pipelined; default 64M, the messenger's)",
    )
    parser.add_argument(
        "--mooncake-python",
        default=os.environ.get("KVCACHE_MOONCAKE_PYTHON", DEFAULT_MC_PYTHON),
        help="a Python with mooncake-transfer-engine-non-cuda installed",
    )
    parser.add_argument(
        "--mooncake-peers",
        type=Path,
        default=DEFAULT_PEERS,
        help="directory holding mooncake_te_bench.py (default: ../shared/peers)",
    )
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake TE rounds")
    parser.add_argument(
        "--no-tls",
        action="store_true",
        help="skip the messenger rounds over TLS (the data port of a --tls cluster)",
    )
    parser.add_argument(
        "--no-e2e",
        action="store_true",
        help="skip the rounds between two real node+messenger pairs (they need 2x --total of "
        "shared memory)",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="instead: real node+messenger pairs on two hosts in network namespaces, per link "
        "rate in --rates, against a raw socket on the same link (needs root; "
        "bench/micro/transfer_hosts.py)",
    )
    parser.add_argument(
        "--rates",
        default="none,10gbit",
        help="with --hosts: link rates (tc tbf, each way) to compare; 'none' is unshaped "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--subnet", default="10.77.10.0/24", help="with --hosts: the hosts' subnet (%(default)s)"
    )
    parser.add_argument(
        "--net-prefix",
        default="kvbench",
        help="with --hosts: name prefix of the namespaces and links (%(default)s)",
    )
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a GB/s bar chart PNG here")
    # Child role of the raw reference (internal).
    parser.add_argument(
        "--role", default="main", choices=["main", "raw-sender"], help=argparse.SUPPRESS
    )
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=MIB, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)


def _ratio_rows(results: list[Measurement]) -> list[dict]:
    rows = []
    for m in results:
        row = m.as_row()
        same = [r for r in results if r.page_bytes == m.page_bytes]
        raw = next(r for r in same if r.method == "raw socket")
        mc = next((r for r in same if r.method == MOONCAKE_METHOD), None)
        row["vs_raw"] = m.gbps / raw.gbps
        row["vs_mooncake"] = m.gbps / mc.gbps if mc else None
        rows.append(row)
    return rows


def _verdict(value: float | None, goal: float) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}x ({'meets' if value >= goal else 'BELOW'} the {goal:g}x goal)"


def run(args: argparse.Namespace) -> int:
    if args.role == "raw-sender":
        raw_sender(args.port, args.total, args.chunk, args.rounds, args.host)
        return 0
    try:
        sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
        lanes_list = [int(x) for x in str(args.lanes).split(",") if x.strip()]
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise SystemExit(f"kvcache bench transfer: {e}") from None
    if args.runs < 1 or not sizes or not lanes_list or min(lanes_list) < 1:
        raise SystemExit("kvcache bench transfer: --runs, --sizes and --lanes need positive values")
    for size in sizes:
        if args.total % size or size % 4096:
            raise SystemExit(
                f"kvcache bench transfer: --total {args.total} must be a multiple of page size "
                f"{size}, and page sizes multiples of 4096"
            )
        if not args.no_e2e:
            e2e_layout_spec(size)
    e2e_lanes = None if args.no_e2e else max(lanes_list)
    if args.hosts:
        from .transfer_hosts import run_hosts

        args.sizes_bytes = sizes
        return run_hosts(args)
    print(
        f"transfer benchmark: {human(args.total)} per round, pages {', '.join(map(human, sizes))},"
        f" median of {args.runs} rounds, every method's rounds interleaved, loopback",
        flush=True,
    )
    mooncake, mc_note = None, "Mooncake TE skipped (--no-mooncake)"
    results: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
        if not args.no_mooncake:
            mooncake, mc_note = start_mooncake(
                args.mooncake_python, args.mooncake_peers, args.total, f"{tmp}/te_child.log"
            )
        print(mc_note, flush=True)
        tls = None if args.no_tls else make_local_ca(f"{tmp}/tls", [])
        try:
            for size in sizes:
                for m in bench_size(
                    args.total,
                    size,
                    args.runs,
                    lanes_list,
                    args.request_bytes,
                    e2e_lanes,
                    mooncake,
                    tls,
                ):
                    results.append(m)
                    print(f"  {human(size):>7} {m.method:<24} {m.gbps:6.3f} GB/s", flush=True)
        finally:
            if mooncake is not None:
                mooncake.close()
    if mooncake is not None:
        for m in results:
            if m.method == MOONCAKE_METHOD:
                m.note = "verified" if mooncake.verified else "VERIFY FAILED"

    rows = _ratio_rows(results)
    print()
    print_table(
        rows,
        [
            Column("page", "page"),
            Column("method", "method"),
            Column("gbps", "GB/s", "{:.3f}"),
            Column("pages_per_s", "pages/s", "{:.0f}"),
            Column("vs_raw", "x raw socket", "{:.2f}"),
            Column("vs_mooncake", "x Mooncake read", "{:.2f}"),
            Column("note", "note"),
        ],
        title="messenger TCP transfer vs references (same run)",
    )
    if e2e_lanes:
        print("\nthe figure that counts: pulls through real node + messenger processes")
        for row in rows:
            if row["method"] == E2E_METHOD.format(lanes=e2e_lanes):
                print(
                    f"{row['page']:>7} {row['gbps']:.3f} GB/s: "
                    f"{_verdict(row['vs_raw'], GOAL_VS_RAW)} raw socket, "
                    f"{_verdict(row['vs_mooncake'], GOAL_VS_MOONCAKE)} Mooncake TE read"
                )
    if args.out:
        write_json(
            args.out,
            {
                "bench": "transfer",
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "total_bytes": args.total,
                "runs": args.runs,
                "mooncake": mc_note,
                "goals": {"vs_raw": GOAL_VS_RAW, "vs_mooncake": GOAL_VS_MOONCAKE},
                "results": rows,
            },
        )
    if args.plot:
        methods = list(dict.fromkeys(r["method"] for r in rows))
        labels = list(dict.fromkeys(r["page"] for r in rows))
        groups = {
            meth: [
                next((r["gbps"] for r in rows if r["method"] == meth and r["page"] == lab), None)
                for lab in labels
            ]
            for meth in methods
        }
        plot_bars(
            args.plot,
            labels,
            groups,
            title=f"transfer of {human(args.total)} on loopback",
            ylabel="GB/s",
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.micro.transfer", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
