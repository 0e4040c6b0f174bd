"""``kvcache bench transfer --hosts``: pages between two hosts in network namespaces, on an
unshaped link and on links shaped with ``tc tbf`` (e.g. 10 Gbit/s).

Two hosts (network namespaces on one bridge, ``plumbing/netns.py``) each run a real node server and
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

import os
import subprocess
import sys
import tempfile
import time

from bench.report import Column, human, print_table, write_json
from plumbing.netns import HostNetwork, NetnsError, NetSpec, parse_rate, unavailable_reason

from .transfer_rig import MIB, ROOT, Measurement, NodePair, RawReference


def _raw_receiver(host: str, total: int, rounds: int, sender_netns: str) -> None:
    """Child role, in the destination host: the raw reference (``RawReference``) with its
    sender in ``sender_netns``; per line on stdin one round, its seconds printed."""
    ref = RawReference(total, MIB, rounds, host, ["ip", "netns", "exec", sender_netns])
    print("READY", flush=True)
    try:
        for _line in sys.stdin:
            print(f"{ref.round():.9f}", flush=True)
    finally:
        ref.close()


class RawLink:
    """The raw socket reference between two hosts: receiver in ``dst``, sender in ``src``."""

    def __init__(self, net: HostNetwork, src: str, dst: str, total: int, rounds: int) -> None:
        self.receiver = subprocess.Popen(
            [*net.exec_prefix(dst), sys.executable, "-m", "bench.micro.transfer_hosts",
             "raw-receiver", net.host(dst).address, str(total), str(rounds),
             net.host(src).netns],
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.receiver.stdout is not None
        line = self.receiver.stdout.readline()
        if line.strip() != "READY":
            self.receiver.kill()
            raise RuntimeError(f"raw receiver did not start: {line!r}")

    def round(self) -> float:
        assert self.receiver.stdin is not None and self.receiver.stdout is not None
        self.receiver.stdin.write("G\n")
        self.receiver.stdin.flush()
        line = self.receiver.stdout.readline()
        if not line:
            raise RuntimeError("raw receiver exited (wrong bytes or a closed sender)")
        return float(line)

    def close(self) -> None:
        if self.receiver.stdin:
            self.receiver.stdin.close()
        try:
            self.receiver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.receiver.kill()


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
                        link = RawLink(net, "src", "dst", args.total, args.runs + 1)
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
    if len(sys.argv) != 6 or sys.argv[1] != "raw-receiver":
        sys.exit("internal child role: raw-receiver HOST TOTAL ROUNDS SENDER_NETNS")
    _raw_receiver(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
