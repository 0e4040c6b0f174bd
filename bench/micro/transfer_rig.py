"""The two ends of a transfer measurement, shared by ``kvcache bench transfer`` (loopback,
``transfer.py``), its ``--hosts`` mode (``transfer_hosts.py``) and the reference of ``kvcache
bench live``: the raw socket copy (``RawReference``), real node + messenger process pairs
(``NodePair``) and bulk pulls between two running nodes (``MessengerPull``), each timed round
recorded in a ``Measurement``."""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.report import human
from clients.messenger_client import MessengerClient
from clients.node_client import KVStoreClient
from proto import messenger_pb2 as mpb

MIB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]  # the repository (the cwd of the child processes)


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


def raw_sender(port: int, total: int, chunk: int, rounds: int, host: str = "127.0.0.1") -> None:
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
                "bench.micro.transfer",
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


# ---- end to end: node + messenger processes ------------------------------------------------------


def e2e_layout_spec(page_bytes: int) -> str:
    """A fp16 layout whose page is ``page_bytes`` (8 KiB per layer-block-token unit)."""
    unit = 2 * 32 * 8 * 128 * 2  # K|V x 32 tokens x 8 heads x 128 dims x fp16 = 128 KiB
    if page_bytes % unit:
        raise SystemExit(f"the end-to-end rows need page sizes that are multiples of {unit} bytes")
    return (
        f"model=bench,num_layers={page_bytes // unit},kv_heads=8,head_dim=128,"
        "dtype=float16,block_tokens=32"
    )


class MessengerPull:
    """Bulk pulls through real messengers between two running nodes: one ``SubmitTransfer`` of
    every page to the destination's messenger, timed from the submit to the finished status
    (the destination's Allocate and Commit, the source's Acquire and Release, both messengers'
    checksums and the TCP lanes included). ``bench live`` measures its reference with it too.

    It stores ``n`` random pages on the source under keys of their own; each ``round`` first
    removes them from the destination (untimed), so every round moves all of them."""

    def __init__(
        self,
        src: KVStoreClient,
        dst: KVStoreClient,
        dst_messenger: MessengerClient,
        src_messenger: str,
        namespace: str,
        n: int,
        salt: bytes,
    ) -> None:
        from kvstore.keys import keys_from_block_ids, root_key

        self.src, self.dst, self.messenger = src, dst, dst_messenger
        self.src_messenger, self.namespace = src_messenger, namespace
        self.page_bytes = src.namespace_info(namespace).page_bytes
        self.keys = keys_from_block_ids(list(range(n)), root_key(namespace, salt))
        self.pages = np.random.default_rng(0).integers(0, 256, (n, self.page_bytes), dtype=np.uint8)
        self.store()

    def store(self) -> None:
        """(Re)store the pages on the source: keys it still holds are left as they are."""
        batch = max(1, (64 << 20) // self.page_bytes)
        for s in range(0, len(self.keys), batch):
            self.src.put(
                self.namespace, list(self.pages[s : s + batch]), keys=self.keys[s : s + batch]
            )

    @property
    def total_bytes(self) -> int:
        return len(self.keys) * self.page_bytes

    def round(self, timeout_s: float = 600.0) -> float:
        n = len(self.keys)
        self.dst.remove(self.namespace, keys=self.keys)
        t0 = time.perf_counter()
        reply = self.messenger.submit(self.namespace, [(k, self.src_messenger) for k in self.keys])
        status = self.messenger.status(reply.batch_id, wait=True, timeout_s=timeout_s)
        dt = time.perf_counter() - t0
        if status.done != n:
            bad = next((e for e in status.entries if e.state != mpb.ENTRY_DONE), None)
            why = f"{bad.code} {bad.reason}" if bad else "not finished in time"
            raise RuntimeError(f"messenger pull: {status.done}/{n} pages done: {why}")
        return dt

    def verify(self, samples: int | None = 16) -> bool:
        """``samples`` pages spread over the batch (None: every page, 64 at a time) equal the
        source's on the destination."""
        n = len(self.keys)
        idx = list(range(0, n, max(1, n // samples))) if samples else list(range(n))
        for s in range(0, len(idx), 64):
            part = idx[s : s + 64]
            got = self.dst.get(self.namespace, keys=[self.keys[i] for i in part])
            if not all(
                g is not None and np.array_equal(g, self.pages[i]) for g, i in zip(got, part)
            ):
                return False
        return True

    def cleanup(self) -> None:
        for client in (self.dst, self.src):
            client.remove(self.namespace, keys=self.keys)


class NodePair:
    """A source and a destination host, each a real node server and messenger process, and a
    ``MessengerPull`` of ``total`` bytes between them. ``sites`` places them: (command prefix,
    IP) per host, e.g. ``ip netns exec NS`` and the namespace's address; loopback by default."""

    def __init__(
        self,
        total: int,
        page_bytes: int,
        lanes: int,
        sites: list[tuple[list[str], str]] | None = None,
    ) -> None:
        from node.config import parse_layout
        from plumbing.launch import start_service

        layout_spec = e2e_layout_spec(page_bytes)
        namespace = parse_layout(layout_spec).namespace
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
            src_node, src_msg, dst_node, dst_msg = self.procs
            a, b = KVStoreClient(src_node.address), KVStoreClient(dst_node.address)
            mb = MessengerClient(dst_msg.address)
            self.clients += [a, b, mb]
            n = total // page_bytes
            self.pull = MessengerPull(a, b, mb, src_msg.address, namespace, n, b"bench-transfer")
        except BaseException:
            self.close()
            raise

    def round(self) -> float:
        return self.pull.round()

    def verify(self) -> None:
        """Every page on the destination equals the source's, byte for byte."""
        if not self.pull.verify(samples=None):
            raise RuntimeError("transfer delivered wrong bytes")

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for sp in reversed(self.procs):
            sp.stop()
