"""``kvcache bench transfer``: messenger TCP transfer throughput against references run alongside.

For each page size, ``--total`` bytes move from a source process to this process, three ways:

- **raw**: the reference. A plain two-process Python socket copy: the child ``sendall``s
  page-sized memoryview slices of a prefaulted buffer, this process ``recv_into``s a
  preallocated buffer (the shape of ``shared/peers/baseline_bench.py``, in the pull direction).
- **messenger**: the real TCP transport. The child is ``python -m messenger.slab_peer`` (a
  ``DataServer`` over a shared-memory slab of pages); this process calls ``TcpTransport.fetch``
  for every page's key into page views of its own shared-memory slab: request framing, lanes,
  pipelining and xxh3 checksums on both sides included.
- **mooncake**: Mooncake's Transfer Engine over TCP (``mooncake_te_bench.py`` from
  ``shared/peers``, batch read = a pull, and batch write), when a Python with
  ``mooncake-transfer-engine-non-cuda`` is available (``--mooncake-python``); skipped with a
  message otherwise.

Raw and messenger rounds alternate (so load from elsewhere hits both alike); median of ``--runs``
timed rounds after one warm-up; GB/s = 1e9 bytes/s. Ratios are printed
against the raw socket and against Mooncake's batch read.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvstore.shm import SharedSlab, unique_shm_name

from .report import Column, plot_bars, print_table, write_json

MIB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEERS = ROOT.parent / "shared" / "peers"
DEFAULT_MC_PYTHON = "/tmp/mc-venv/bin/python"


def parse_bytes(text: str) -> int:
    """'1G', '64M', '4MiB', '4096' -> bytes (binary suffixes: these are buffer sizes)."""
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 1G, 64M, 4096") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number of bytes")
    return int(value)


def human(n: int) -> str:
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m and n % m == 0:
            return f"{n // m} {unit}"
    return f"{n} B"


@dataclass
class Measurement:
    method: str
    page_bytes: int
    total_bytes: int
    runs_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def gbps(self) -> float:
        return self.total_bytes / self.median_s / 1e9

    def as_row(self) -> dict:
        return {
            "method": self.method,
            "page": human(self.page_bytes),
            "gbps": self.gbps,
            "runs": [round(self.total_bytes / s / 1e9, 3) for s in self.runs_s],
            "pages_per_s": self.total_bytes / self.page_bytes / self.median_s,
            "note": self.note,
        }


# ---- raw socket reference ---------------------------------------------------------------------


def _raw_sender(port: int, total: int, chunk: int, rounds: int, host: str = "127.0.0.1") -> None:
    """Child role: wait for a request byte, send ``total`` bytes in ``chunk`` slices, repeat."""
    data = bytearray(total)
    mv = memoryview(data)
    for off in range(0, total, MIB):  # prefault and give the bytes a value
        data[off : off + MIB] = b"\x09" * min(MIB, total - off)
    with socket.create_connection((host, port)) as s:
        for _ in range(rounds):
            if s.recv(1) != b"G":
                return
            for off in range(0, total, chunk):
                s.sendall(mv[off : off + chunk])


class RawReference:
    """The raw socket pair for one page size; ``round()`` times one ``total``-byte copy. The
    sender connects to ``host``; ``wrap`` runs it elsewhere (``ip netns exec NS``)."""

    def __init__(
        self,
        total: int,
        chunk: int,
        rounds: int,
        host: str = "127.0.0.1",
        wrap: list[str] | None = None,
    ) -> None:
        self.total = total
        listener = socket.create_server((host, 0))
        port = listener.getsockname()[1]
        self.child = subprocess.Popen(
            [
                *(wrap or []),
                sys.executable,
                "-m",
                "bench.transfer",
                "--role",
                "raw-sender",
                "--port",
                str(port),
                "--total",
                str(total),
                "--chunk",
                str(chunk),
                "--rounds",
                str(rounds),
                "--host",
                host,
            ],
            cwd=ROOT,
        )
        try:
            listener.settimeout(60)
            self.conn, _ = listener.accept()
        finally:
            listener.close()
        self.buf = np.zeros(total, dtype=np.uint8)  # prefaulted
        self.view = memoryview(self.buf)

    def round(self) -> float:
        total, mv, conn = self.total, self.view, self.conn
        t0 = time.perf_counter()
        conn.sendall(b"G")
        pos = 0
        while pos < total:
            n = conn.recv_into(mv[pos:], total - pos)
            if n == 0:
                raise RuntimeError("raw sender closed early")
            pos += n
        dt = time.perf_counter() - t0
        if not (self.buf[0] == 9 and self.buf[-1] == 9):
            raise RuntimeError("raw reference received wrong bytes")
        return dt

    def close(self) -> None:
        self.conn.close()
        self.child.wait(timeout=60)


# ---- the messenger's TCP transport ------------------------------------------------------------


class MessengerSide:
    """A slab peer (source process) and this process's destination slab for one page size."""

    def __init__(self, total: int, page_bytes: int, request_bytes: int) -> None:
        from messenger.slab_peer import NAMESPACE, pattern_keys

        self.n = total // page_bytes
        self.page_bytes, self.request_bytes = page_bytes, request_bytes
        self.namespace = NAMESPACE
        self.child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "messenger.slab_peer",
                "--pages",
                str(self.n),
                "--page-bytes",
                str(page_bytes),
            ],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.slab = SharedSlab.create(unique_shm_name("bench-dst"), self.n * page_bytes)
        self.transports: dict = {}
        line = self.child.stdout.readline()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"slab peer did not start: {line!r}")
        self.address = json.loads(line[6:])["address"]
        self.pages = self.slab.array.reshape(self.n, page_bytes)
        self.pages[:] = 0  # prefault, as the raw reference's buffer is
        self.keys = pattern_keys(self.n)
        self.views = [memoryview(self.pages[i]) for i in range(self.n)]

    def round(self, lanes: int) -> float:
        from messenger.tcp import TcpConfig, TcpTransport

        transport = self.transports.get(lanes)
        if transport is None:
            transport = TcpTransport(TcpConfig(lanes=lanes, request_bytes=self.request_bytes))
            self.transports[lanes] = transport
        t0 = time.perf_counter()
        results = transport.fetch(self.address, self.namespace, self.keys, self.views)
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
        self.child.stdin.close()
        self.child.wait(timeout=60)
        self.views = self.pages = None
        self.slab.close()
        self.slab.unlink()


def bench_size(
    total: int, page_bytes: int, runs: int, lanes_list: list[int], request_bytes: int
) -> list[Measurement]:
    """Raw and messenger rounds interleaved (raw, x1, x2, raw, ...) so that load from elsewhere
    on the machine hits every method alike; the first round of each is a warm-up."""
    raw = RawReference(total, page_bytes, runs + 1)
    side = MessengerSide(total, page_bytes, request_bytes)
    out = [Measurement("raw socket", page_bytes, total)]
    out += [Measurement(f"messenger tcp x{lanes}", page_bytes, total) for lanes in lanes_list]
    try:
        for r in range(runs + 1):
            times = [raw.round()] + [side.round(lanes) for lanes in lanes_list]
            if r:
                for m, t in zip(out, times):
                    m.runs_s.append(t)
        ok = side.verify()
    finally:
        raw.close()
        side.close()
    if not ok:
        raise RuntimeError("messenger transfer delivered wrong bytes")
    for m in out[1:]:
        m.note = "verified"
    return out


# ---- end to end: node + messenger processes ------------------------------------------------------


def _bench_layout(page_bytes: int) -> str:
    """A fp16 layout whose page is ``page_bytes`` (8 KiB per layer-block-token unit)."""
    unit = 2 * 32 * 8 * 128 * 2  # K|V x 32 tokens x 8 heads x 128 dims x fp16 = 128 KiB
    if page_bytes % unit:
        raise SystemExit(f"--e2e needs page sizes that are multiples of {unit} bytes")
    return (
        f"model=bench,num_layers={page_bytes // unit},kv_heads=8,head_dim=128,"
        "dtype=float16,block_tokens=32"
    )


class NodePair:
    """A source and a destination host, each a real node server and messenger process, with
    ``total`` bytes of random pages on the source. ``sites`` places them: (command prefix, IP)
    per host, e.g. ``ip netns exec NS`` and the namespace's address; loopback by default."""

    def __init__(
        self,
        total: int,
        page_bytes: int,
        lanes: int,
        sites: list[tuple[list[str], str]] | None = None,
    ) -> None:
        from clients.messenger_client import MessengerClient
        from clients.node_client import KVStoreClient
        from kvstore.keys import keys_from_block_ids, root_key
        from node.config import parse_layout
        from rpc.launch import start_service

        layout_spec = _bench_layout(page_bytes)
        self.namespace = parse_layout(layout_spec).namespace
        self.n = n = total // page_bytes
        dram = str(total + 64 * page_bytes)
        self.procs: list = []
        self.clients: list = []
        try:
            for wrap, ip in sites or [([], "127.0.0.1")] * 2:
                self.procs.append(
                    start_service(
                        ["node", "--listen", f"{ip}:0", "--dram", dram, "--layout", layout_spec],
                        wrap=wrap,
                    )
                )
                self.procs.append(
                    start_service(
                        [
                            "messenger",
                            "--node",
                            self.procs[-1].address,
                            "--listen",
                            f"{ip}:0",
                            "--transport",
                            "tcp",
                            "--lanes",
                            str(lanes),
                        ],
                        wrap=wrap,
                    )  # fmt: skip
                )
            src_node, self.src_msg, dst_node, dst_msg = self.procs
            a, self.dst = KVStoreClient(src_node.address), KVStoreClient(dst_node.address)
            self.mb = MessengerClient(dst_msg.address)
            self.clients += [a, self.dst, self.mb]
            self.keys = keys_from_block_ids(list(range(n)), root_key(self.namespace, b"bench"))
            self.pages = np.random.default_rng(0).integers(0, 256, (n, page_bytes), np.uint8)
            for s in range(0, n, 64):
                a.put(self.namespace, list(self.pages[s : s + 64]), keys=self.keys[s : s + 64])
        except BaseException:
            self.close()
            raise

    def round(self) -> float:
        """Drop the pages on the destination, then time SubmitTransfer -> all done."""
        self.dst.remove(self.namespace, keys=self.keys)
        t0 = time.perf_counter()
        reply = self.mb.submit(self.namespace, [(k, self.src_msg.address) for k in self.keys])
        status = self.mb.status(reply.batch_id, wait=True, timeout_s=600)
        dt = time.perf_counter() - t0
        if status.done != self.n:
            bad = next(e for e in status.entries if e.state != 2)
            raise RuntimeError(f"transfer: {status.done}/{self.n} done: {bad.code} {bad.reason}")
        return dt

    def verify(self) -> None:
        """Every page on the destination equals the source's, byte for byte."""
        for s in range(0, self.n, 64):
            got = self.dst.get(self.namespace, keys=self.keys[s : s + 64])
            if not all(np.array_equal(g, p) for g, p in zip(got, self.pages[s : s + 64])):
                raise RuntimeError("transfer delivered wrong bytes")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for sp in reversed(self.procs):
            sp.stop()


def bench_e2e(total: int, page_bytes: int, runs: int, lanes: int) -> Measurement:
    """SubmitTransfer of ``total`` bytes between two real node+messenger pairs, timed from the
    submit to the finished status: Acquire/Allocate/Commit RPCs and slab mapping included."""
    m = Measurement(f"e2e messenger x{lanes}", page_bytes, total)
    pair = NodePair(total, page_bytes, lanes)
    try:
        for r in range(runs + 1):
            dt = pair.round()
            if r:
                m.runs_s.append(dt)
        pair.verify()
        m.note = "verified"
    finally:
        pair.close()
    return m


# ---- Mooncake Transfer Engine -----------------------------------------------------------------


def bench_mooncake(
    python: str, script: Path, total: int, sizes: list[int], runs: int
) -> tuple[list[Measurement], str]:
    if not (os.path.exists(python) and script.exists()):
        return [], (
            f"Mooncake TE skipped: need {python} with mooncake-transfer-engine-non-cuda "
            f"(python -m venv /tmp/mc-venv && /tmp/mc-venv/bin/pip install "
            f"mooncake-transfer-engine-non-cuda numpy) and {script}"
        )
    check = subprocess.run([python, "-c", "import mooncake.engine"], capture_output=True)
    if check.returncode:
        return [], f"Mooncake TE skipped: {python} cannot import mooncake.engine"
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
        out = Path(tmp) / "te.json"
        cmd = [
            python,
            str(script),
            "--sizes",
            ",".join(str(s) for s in sizes),
            "--total",
            str(total),
            "--runs",
            str(runs),
            "--ops",
            "read,write",
            "--json",
            str(out),
            "--child-log",
            str(Path(tmp) / "te_child.log"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode or not out.exists():
            tail = (proc.stdout + proc.stderr)[-600:]
            return [], f"Mooncake TE failed (exit {proc.returncode}): {tail}"
        data = json.loads(out.read_text())
    ms = []
    for r in data["results"]:
        op = "batch read (pull)" if r["op"] == "read" else "batch write (push)"
        m = Measurement(
            f"mooncake TE {op}",
            r["block"],
            r["total_bytes"],
            list(r["runs_s"]),
            note="verified" if data.get("verify_ok") else "",
        )
        ms.append(m)
    note = "Mooncake TE over TCP: " + (
        "private loopback netns" if data.get("isolated_netns") else "host network"
    )
    return ms, note


# ---- command -----------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--total",
        type=parse_bytes,
        default=1 << 30,
        help="bytes moved per run and page size (default 1G; e.g. 128M quick)",
    )
    parser.add_argument("--sizes", default="1M,4M", help="page sizes (default 1M,4M)")
    parser.add_argument("--runs", type=int, default=3, help="timed runs (median reported)")
    parser.add_argument("--lanes", default="1,2", help="messenger TCP lanes; a list compares")
    parser.add_argument(
        "--request-bytes",
        type=parse_bytes,
        default=32 << 20,
        help="bytes of pages per messenger request (pipelined)",
    )
    parser.add_argument(
        "--mooncake-python",
        default=os.environ.get("KVCACHE_MOONCAKE_PYTHON", DEFAULT_MC_PYTHON),
        help="a Python with mooncake-transfer-engine-non-cuda installed",
    )
    parser.add_argument(
        "--mooncake-script", type=Path, default=DEFAULT_PEERS / "mooncake_te_bench.py"
    )
    parser.add_argument("--no-mooncake", action="store_true", help="skip the Mooncake TE runs")
    parser.add_argument(
        "--e2e",
        action="store_true",
        help="also time SubmitTransfer between two real node+messenger pairs "
        "(needs 2x --total of shared memory)",
    )
    parser.add_argument(
        "--hosts",
        action="store_true",
        help="instead: real node+messenger pairs on two hosts in network namespaces, per link "
        "rate in --rates, against a raw socket on the same link (needs root; "
        "bench/transfer_hosts.py)",
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


def run(args: argparse.Namespace) -> int:
    if args.role == "raw-sender":
        _raw_sender(args.port, args.total, args.chunk, args.rounds, args.host)
        return 0
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]
    lanes_list = [int(x) for x in str(args.lanes).split(",") if x.strip()]
    if args.runs < 1 or not sizes or not lanes_list or min(lanes_list) < 1:
        raise SystemExit("--runs, --sizes and --lanes need positive values")
    for size in sizes:
        if args.total % size or size % 4096:
            raise SystemExit(
                f"--total {args.total} must be a multiple of page size {size}, "
                "and page sizes multiples of 4096"
            )
    if args.hosts:
        from .transfer_hosts import run_hosts

        args.sizes_bytes = sizes
        return run_hosts(args)
    print(
        f"transfer benchmark: {human(args.total)} per run, pages {', '.join(map(human, sizes))},"
        f" median of {args.runs} runs, loopback, 2 processes each",
        flush=True,
    )
    results: list[Measurement] = []
    for size in sizes:
        for m in bench_size(args.total, size, args.runs, lanes_list, args.request_bytes):
            results.append(m)
            print(f"  {human(size):>7} {m.method:<21} {m.gbps:6.3f} GB/s", flush=True)
        if args.e2e:
            m = bench_e2e(args.total, size, args.runs, lanes_list[-1])
            results.append(m)
            print(f"  {human(size):>7} {m.method:<21} {m.gbps:6.3f} GB/s", flush=True)
    mc_note = "Mooncake TE skipped (--no-mooncake)"
    if not args.no_mooncake:
        print("  running Mooncake TE (shared/peers/mooncake_te_bench.py) ...", flush=True)
        mc, mc_note = bench_mooncake(
            args.mooncake_python, args.mooncake_script, args.total, sizes, args.runs
        )
        results += mc
    print(mc_note)

    rows = []
    for m in results:
        row = m.as_row()
        raw = next(r for r in results if r.method == "raw socket" and r.page_bytes == m.page_bytes)
        mc_read = next(
            (
                r
                for r in results
                if r.method.startswith("mooncake TE batch read") and r.page_bytes == m.page_bytes
            ),
            None,
        )
        row["vs_raw"] = m.gbps / raw.gbps
        row["vs_mooncake"] = m.gbps / mc_read.gbps if mc_read else None
        rows.append(row)
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
    target = 0.60
    for row in rows:
        if row["method"].startswith(("messenger", "e2e")):
            verdict = "meets" if row["vs_raw"] >= target else "BELOW"
            mc = f", {row['vs_mooncake']:.2f}x Mooncake TE read" if row["vs_mooncake"] else ""
            print(
                f"{row['page']:>7} {row['method']}: {row['vs_raw']:.2f}x raw socket "
                f"({verdict} the {target:.0%} target){mc}"
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
    parser = argparse.ArgumentParser(prog="python -m bench.transfer", description=__doc__)
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
