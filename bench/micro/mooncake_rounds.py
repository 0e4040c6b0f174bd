"""Mooncake Transfer Engine rounds on command, so ``kvcache bench transfer`` can interleave them
with its own rounds (load from elsewhere on the machine then hits every method alike).

Run by a Python that has ``mooncake-transfer-engine-non-cuda`` (not this project's venv; nothing
of the project is imported): ``python bench/micro/mooncake_rounds.py --peers DIR --total BYTES``.
It uses ``DIR/mooncake_te_bench.py`` (shared/peers) for everything Mooncake: a private loopback-only
network namespace, a target process with a registered buffer of ``--total`` bytes, the initiator's
engine and buffer, the warm-up, and the timed ``batch_transfer_sync_read`` / ``_write`` loop.

Protocol on stdin / stdout, one line each: it prints ``READY {json}`` once set up; then for each
``read BLOCK`` or ``write BLOCK`` line it moves ``--total`` bytes in blocks of ``BLOCK`` and
prints ``SECONDS <float>``; on EOF it writes everything, reads samples back, compares them and
prints ``VERIFY OK`` or ``VERIFY MISMATCH``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MIB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peers", required=True, help="directory holding mooncake_te_bench.py")
    ap.add_argument("--total", type=int, required=True, help="bytes moved per round")
    ap.add_argument("--batch-bytes", type=int, default=64 * MIB)
    ap.add_argument("--child-log", default=os.devnull, help="the target's stderr (glog)")
    ap.add_argument("--no-isolate", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, args.peers)
    import mooncake_te_bench as mtb  # noqa: PLC0415 - found through --peers only

    isolated = not args.no_isolate and mtb.isolate_network()
    script = os.path.join(args.peers, "mooncake_te_bench.py")
    with open(args.child_log, "w") as log:
        child = subprocess.Popen(
            [sys.executable, script, "--role", "target", "--total", str(args.total)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
    try:
        info = next((json.loads(ln[6:]) for ln in child.stdout if ln.startswith("READY ")), None)
        if info is None:
            print("FAILED the target did not start; see its log", flush=True)
            return 1
        target, remote = f"127.0.0.1:{info['port']}", info["addr"]
        te = mtb.new_engine("127.0.0.1")
        src = mtb.alloc_buffer(args.total, 0)
        rows = src.reshape(-1, MIB)
        rows[:] = mtb.np.random.default_rng(1).integers(0, 256, MIB, dtype=mtb.np.uint8)
        rows[:, 0] = mtb.np.arange(rows.shape[0]) % 256
        if te.register_memory(src.ctypes.data, src.nbytes) != 0:
            print("FAILED register_memory", flush=True)
            return 1
        local, warm = src.ctypes.data, min(args.total, 64 * MIB)
        for op in ("write", "read"):  # opens the segment and the connections (not timed)
            mtb.time_batches(te, target, op, local, remote, warm, MIB, args.batch_bytes)
        print("READY " + json.dumps({"isolated_netns": bool(isolated)}), flush=True)
        for line in sys.stdin:
            op, block = line.split()
            dt = mtb.time_batches(
                te, target, op, local, remote, args.total, int(block), args.batch_bytes
            )
            print(f"SECONDS {dt}", flush=True)
        scratch = mtb.alloc_buffer(4 * MIB, 0)
        te.register_memory(scratch.ctypes.data, scratch.nbytes)
        mtb.time_batches(te, target, "write", local, remote, args.total, 4 * MIB, args.batch_bytes)
        ok = True
        for off in (0, args.total // 2, args.total - 4 * MIB):
            rc = te.transfer_sync_read(target, scratch.ctypes.data, remote + off, 4 * MIB)
            ok &= rc == 0 and bool(mtb.np.array_equal(scratch, src[off : off + 4 * MIB]))
        print("VERIFY " + ("OK" if ok else "MISMATCH"), flush=True)
        return 0
    finally:
        child.stdin.close()
        child.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
