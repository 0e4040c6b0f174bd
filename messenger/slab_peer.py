"""A standalone page source for transport tests and the transfer benchmark.

``python -m messenger.slab_peer --pages N --page-bytes B`` fills a shared-memory slab with
``fill_pattern`` and serves it on a data port with ``DataServer``. It prints ``READY <json>``
with its data address once listening and runs until its stdin closes, so the parent controls its
life without signals.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import xxhash

from kvstore.shm import SharedSlab, unique_shm_name

from .data_security import server_context
from .data_server import DataServer, SenderFaults
from .transport import SlabPageSource

NAMESPACE = "slab-peer|test"


def pattern_keys(n: int, seed: int = 0) -> list[bytes]:
    prefix = b"slab-peer/%d/" % seed
    return [xxhash.xxh3_128_digest(prefix + i.to_bytes(8, "little")) for i in range(n)]


def fill_pattern(pages: np.ndarray, seed: int = 0, first_index: int = 0) -> None:
    """Deterministic, page-distinct bytes: one random page tiled, every 4 KiB stamped with the
    page index, so a swapped or shifted page never matches."""
    n, page_bytes = pages.shape
    base = np.random.default_rng(seed).integers(0, 256, page_bytes, dtype=np.uint8)
    pages[:] = base
    words = pages.view(np.uint64)
    words[:, ::512] = np.arange(first_index, first_index + n, dtype=np.uint64)[:, None] + (
        np.uint64(seed) << np.uint64(32)
    )


def expected_page(index: int, page_bytes: int, seed: int = 0) -> np.ndarray:
    page = np.empty((1, page_bytes), dtype=np.uint8)
    fill_pattern(page, seed, index)
    return page[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pages", type=int, required=True)
    ap.add_argument("--page-bytes", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--missing", default="", help="comma list of page indices not to serve")
    ap.add_argument("--corrupt-every", type=int, default=0)
    ap.add_argument("--io-timeout", type=float, default=30.0)
    ap.add_argument("--tls-cert", default=None, help="serve TLS with this certificate (PEM)")
    ap.add_argument("--tls-key", default=None, help="its private key (PEM)")
    args = ap.parse_args(argv)
    tls = server_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    if args.page_bytes % 4096:
        ap.error("--page-bytes must be a multiple of 4096")
    slab = SharedSlab.create(unique_shm_name("slabpeer"), args.pages * args.page_bytes)
    try:
        pages = slab.array.reshape(args.pages, args.page_bytes)
        fill_pattern(pages, args.seed)
        missing = {int(x) for x in args.missing.split(",") if x}
        keys = pattern_keys(args.pages, args.seed)
        slots = {k: i for i, k in enumerate(keys) if i not in missing}
        source = SlabPageSource(NAMESPACE, slab.array, args.page_bytes, slots)
        server = DataServer(
            source,
            host=args.host,
            io_timeout_s=args.io_timeout,
            faults=SenderFaults(corrupt_every=args.corrupt_every),
            tls=tls,
        ).start()
        print("READY " + json.dumps({"address": server.address, "shm_name": slab.name}), flush=True)
        sys.stdin.read()
        server.stop()
        print("STATS " + json.dumps(vars(server.stats)), flush=True)
    finally:
        del pages
        slab.close()
        slab.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
