"""What the RDMA transport tests share: a source data server with an RDMA source and an RDMA
transport on one fake fabric (``Setup``), and completion polling."""

from __future__ import annotations

import numpy as np

from messenger.data_server import DataServer
from messenger.identity import Identities
from messenger.rdma import RdmaConfig, RdmaSource, RdmaTransport
from messenger.slab_peer import fill_pattern, pattern_keys
from messenger.transport import SlabPageSource
from messenger.verbs_fake import FakeFabric, FakeVerbsBackend

from helpers import wait_until

NS = "rdma|test"
PAGES = 40
PB = 16 << 10


def completions(qp, n, timeout_s=10.0):
    """Poll until ``n`` completions arrived (the fake completes on another thread)."""
    got: list = []
    wait_until(lambda: got.extend(qp.poll(16)) or len(got) >= n, timeout_s, f"{n} completions")
    return got


class Setup:
    def __init__(
        self,
        missing=(),
        with_rdma_source=True,
        config: RdmaConfig | None = None,
        max_send_wr: int = 64,
        token: str | None = None,
        identities: Identities | None = None,
        source_cls: type[RdmaSource] = RdmaSource,
        transport_cls: type[RdmaTransport] = RdmaTransport,
        src_backend_cls: type[FakeVerbsBackend] = FakeVerbsBackend,
        dst_backend_cls: type[FakeVerbsBackend] = FakeVerbsBackend,
    ) -> None:
        self.fabric = FakeFabric()
        self.src_region = np.empty(PAGES * PB, dtype=np.uint8)
        fill_pattern(self.src_region.reshape(PAGES, PB))
        self.keys = pattern_keys(PAGES)
        slots = {k: i for i, k in enumerate(self.keys) if i not in set(missing)}
        self.source = SlabPageSource(NS, self.src_region, PB, slots)
        self.server = DataServer(self.source, token=token, identities=identities).start()
        self.src_backend = src_backend_cls(self.fabric, max_send_wr)
        if with_rdma_source:
            self.rdma_source = source_cls(self.src_backend, self.source)
            self.rdma_source.install(self.server)
        self.dst_backend = dst_backend_cls(self.fabric, max_send_wr)
        self.rdma = transport_cls(
            self.dst_backend, config or RdmaConfig(chain=4, chains_in_flight=2)
        )
        self.dst = np.zeros((PAGES, PB), dtype=np.uint8)
        self.rdma.register_local(self.dst.reshape(-1))
        self.others: list[RdmaTransport] = []  # more pullers a test opened; closed with it

    def views(self, order=None):
        order = range(PAGES) if order is None else order
        return [memoryview(self.dst[i]) for i in order]

    def close(self) -> None:
        self.fabric.unthrottle()
        for t in [self.rdma, *self.others]:
            t.close()
        self.server.stop()
