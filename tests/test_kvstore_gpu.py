"""The GPU tier's torch slab: on "cpu" everywhere, on CUDA where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore import StorageError, Tier
from kvstore.pools import TorchSlabPool

from kvstore_helpers import LAYOUT, key, keys, make_store, page, tiers_of

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
)
def test_torch_slab_pool_pages(device):
    pool = TorchSlabPool(3, LAYOUT.page_bytes, device=device)
    assert pool.tier is Tier.GPU and pool.has_data
    srcs = [page(i).view(np.uint8) for i in range(3)]
    pool.write_pages([2, 0], [key(2), key(0)], [srcs[2], srcs[0]])
    view = pool.page_view(2)
    assert view.device.type == device and view.dtype == torch.uint8
    assert view.numel() == LAYOUT.page_bytes
    out = np.empty(LAYOUT.page_bytes, np.uint8)
    assert pool.read_page_into(0, key(0), out) and out.tobytes() == srcs[0].tobytes()
    out_t = torch.empty(LAYOUT.page_bytes, dtype=torch.uint8, device=device)
    assert pool.read_page_into(2, key(2), out_t)
    assert out_t.cpu().numpy().tobytes() == srcs[2].tobytes()
    pool.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_tier_without_cuda_is_a_clear_error():
    with pytest.raises(StorageError, match="gpu_pages=0"):
        TorchSlabPool(1, LAYOUT.page_bytes, device="cuda")
    with pytest.raises(StorageError, match="CUDA"):
        make_store(gpu_pages=1, dram_pages=1)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]
)
def test_store_gpu_tier_write_demote_and_read(tmp_path, device):
    cfg = dict(
        gpu_pages=2,
        gpu_device=device,
        dram_pages=2,
        ssd_pages=2,
        write_tier=Tier.GPU,
        promote_on_hit=False,
    )
    with make_store(tmp_path, **cfg) as store:
        # a device tensor payload goes straight into the device slab
        store.put([key(0)], [torch.from_numpy(page(0).copy()).to(device)])
        for i in range(1, 6):
            store.put([key(i)], [page(i)])
        assert tiers_of(store) == {
            key(0): "SSD",
            key(1): "SSD",
            key(2): "DRAM",
            key(3): "DRAM",
            key(4): "GPU",
            key(5): "GPU",
        }
        # every page, including the device payload that travelled GPU -> DRAM -> SSD, is intact
        got = store.read(keys(0, 1, 2, 3, 4, 5))
        assert [p.tobytes() for p in got] == [page(i).tobytes() for i in range(6)]
        # copy a GPU-tier page out into a device tensor without leaving the device
        lease = store.acquire([key(5)], into=None)
        assert lease.tiers == [Tier.GPU]
        out = torch.empty(LAYOUT.page_bytes, dtype=torch.uint8, device=device)
        assert store.copy_out(lease, 0, out)
        assert out.cpu().numpy().tobytes() == page(5).tobytes()
        store.release(lease.lease_id)
        assert store.stats().demotions == 6
