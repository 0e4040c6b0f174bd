"""``kvcache bench transfer --hosts``: pages between two hosts in network namespaces, on an
unshaped link and on links shaped with ``tc tbf`` (e.g. 10 Gbit/s).

Two hosts (network namespaces on one bridge, ``rpc/netns.py``) each run a real node server and
messenger; this process, in the root namespace, reaches both through the bridge. For each link
rate in ``--rates`` (a tbf on both ends of both hosts' links, so each host sends and receives at
most that rate; ``none``: unshaped) and each page size:

- **raw**: the reference, on the same link in the same run: a two-process Python socket copy
  from the source host to the destination host (the shape of ``bench transfer``'s raw socket).
- **messenger**: ``SubmitTransfer`` to the destination's messenger for every page the source's
  node holds, timed until ``TransferStatus`` says all are done (Allocate, the messengers' TCP
  lanes, checksums, Commit), then every page checked byte for byte on the destination.

Rounds alternate raw, messenger, raw, ... (median of ``--runs`` after a warm-up). Printed: GB/s,
the ratio to the raw socket on the same link, and on shaped links the fraction of the rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from rpc.netns import HostNetwork, NetnsError, NetSpec, parse_rate, unavailable_reason

from .report import Column, print_table, write_json
from .transfer import MIB, ROOT, Measurement, NodePair, human


def _raw_receiver(host: str, total: int) -> None:
    """Child role (in the destination host): accept the sender, then per line on stdin ask it
    for ``total`` bytes, receive them into a preallocated buffer and print the seconds taken."""
    import socket

    import numpy as np

    listener = socket.create_server((host, 0))
    print(f"PORT {listener.getsockname()[1]}", flush=True)
    conn, _ = listener.accept()
    listener.close()
    buf = np.zeros(total, dtype=np.uint8)
    mv = memoryview(buf)
    for _line in sys.stdin:
        t0 = time.perf_counter()
        conn.sendall(b"G")
        pos = 0
        while pos < total:
            n = conn.recv_into(mv[pos:], total - pos)
            if n == 0:
                raise SystemExit("raw sender closed early")
            pos += n
        print(f"{time.perf_counter() - t0:.9f}", flush=True)
    conn.close()


class RawLink:
    """The raw socket reference between two hosts: receiver child in ``dst``, sender in ``src``."""

    def __init__(
        self, net: HostNetwork, src: str, dst: str, total: int, chunk: int, rounds: int
    ) -> None:
        dst_ip = net.host(dst).address
        self.receiver = subprocess.Popen(
            [*net.exec_prefix(dst), sys.executable, "-m", "bench.transfer_hosts",
             "raw-receiver", dst_ip, str(total)],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.receiver.stdout is not None and self.receiver.stdin is not None
        line = self.receiver.stdout.readline()
        if not line.startswith("PORT "):
            self.receiver.kill()
            raise RuntimeError(f"raw receiver did not start: {line!r}")
        self.sender = subprocess.Popen(
            [*net.exec_prefix(src), sys.executable, "-m", "bench.transfer", "--role",
             "raw-sender", "--host", dst_ip, "--port", line.split()[1], "--total", str(total),
             "--chunk", str(chunk), "--rounds", str(rounds)],
            cwd=ROOT,
        )  # fmt: skip

    def round(self) -> float:
        assert self.receiver.stdin is not None and self.receiver.stdout is not None
        self.receiver.stdin.write("G\n")
        self.receiver.stdin.flush()
        line = self.receiver.stdout.readline()
        if not line:
            raise RuntimeError("raw receiver exited")
        return float(line)

    def close(self) -> None:
        if self.receiver.stdin:
            self.receiver.stdin.close()
        for p in (self.receiver, self.sender):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def run_hosts(args) -> int:
    why = unavailable_reason()
    if why:
        raise SystemExit(f"kvcache bench transfer --hosts: {why}")
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    try:
        for r in rates:
            if r != "none":
                parse_rate(r)
    except NetnsError as e:
        raise SystemExit(f"--rates: {e} (or 'none' for an unshaped link)") from None
    sizes = args.sizes_bytes
    lanes = int(str(args.lanes).split(",")[-1])
    print(
        f"transfer between 2 hosts (network namespaces on a bridge, subnet {args.subnet}): "
        f"{human(args.total)} per run, pages {', '.join(map(human, sizes))}, link rates "
        f"{', '.join(rates)}, median of {args.runs} runs",
        flush=True,
    )
    results: list[tuple[str, Measurement]] = []
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-hosts-") as tmp:
        net = HostNetwork.create(
            NetSpec(prefix=args.net_prefix, subnet=args.subnet),
            ["src", "dst"],
            os.path.join(tmp, "network.json"),
        )
        try:
            sites = [(net.exec_prefix(h), net.host(h).address) for h in ("src", "dst")]
            for size in sizes:
                pair = NodePair(args.total, size, lanes, sites)
                try:
                    for rate in rates:
                        net.shape(None if rate == "none" else rate)
                        raw = Measurement("raw socket", size, args.total)
                        msg = Measurement(f"messenger x{lanes}", size, args.total)
                        link = RawLink(net, "src", "dst", args.total, MIB, args.runs + 1)
                        try:
                            for r in range(args.runs + 1):
                                times = (link.round(), pair.round())
                                if r:
                                    raw.runs_s.append(times[0])
                                    msg.runs_s.append(times[1])
                        finally:
                            link.close()
                        pair.verify()
                        msg.note = "verified"
                        for m in (raw, msg):
                            results.append((rate, m))
                            print(f"  {rate:>7} {human(size):>7} {m.method:<13} {m.gbps:6.3f} GB/s")
                finally:
                    pair.close()
        finally:
            net.teardown()
    rows = []
    for rate, m in results:
        raw = next(
            x for r, x in results if r == rate and x.page_bytes == m.page_bytes and x is not m
        ) if m.method != "raw socket" else m  # fmt: skip
        cap = None if rate == "none" else parse_rate(rate) / 8 / 1e9
        rows.append(
            {
                **m.as_row(),
                "link": "unshaped" if rate == "none" else f"tbf {rate}",
                "vs_raw": m.gbps / raw.gbps,
                "vs_link": m.gbps / cap if cap else None,
                "runs_spread": [min(m.runs_s), max(m.runs_s)],
            }
        )
    print()
    print_table(
        rows,
        [
            Column("link", "link"),
            Column("page", "page"),
            Column("method", "method"),
            Column("gbps", "GB/s", "{:.3f}"),
            Column("vs_raw", "x raw socket", "{:.2f}"),
            Column("vs_link", "x link rate", "{:.2f}"),
            Column("note", "note"),
        ],
        title="pages between two namespaced hosts: messenger vs raw socket, same link, same run",
    )
    for row in rows:
        if row["method"].startswith("messenger"):
            link = f", {row['vs_link']:.2f}x the link rate" if row["vs_link"] else ""
            print(
                f"{row['link']:>14} {row['page']:>7}: messenger {row['gbps']:.3f} GB/s = "
                f"{row['vs_raw']:.2f}x raw socket{link}"
            )
    if args.out:
        write_json(
            args.out,
            {
                "bench": "transfer-hosts",
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                "total_bytes": args.total,
                "runs": args.runs,
                "results": rows,
            },
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "raw-receiver":
        _raw_receiver(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps({"error": "internal child role: raw-receiver HOST TOTAL"}))
        sys.exit(2)
