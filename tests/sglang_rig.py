"""SGLang's own storage side, built on CPU for the HiCache backend's tests.

A ``Rank`` is what one SGLang scheduler process holds for HiCache L3: its real device KV pool,
host pool (any layout), ``HostPoolGroup`` and ``HybridCacheController``, assembled as SGLang's
kv-only stack does (``hybrid_pool_assembler.build_kv_only_stack``, which the engine uses for
MHA and MLA models) except that host memory is not pinned (that needs CUDA). The controller
creates the backend through ``StorageBackendFactory`` ("dynamic") and runs its own prefetch,
backup and sync threads; the test plays the scheduler's part: it queues backups and prefetches,
allocates host memory for the hits and reads the acks. What only an engine shows (device <->
host copies, the radix tree's bookkeeping, collectives across rank processes) is not here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import types
from dataclasses import dataclass, field
from typing import Any

import sglang  # noqa: F401  (transformers settles that torchvision is absent first)
import torch


class _Absent(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Absent(f"{self.__name__}.{name}")


class _LendAbsent(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """SGLang's memory_pool imports all its model configs, and one of them imports torchvision,
    its quantization package gguf, at module level; neither is installed here (the Makefile
    removes torchvision) and no pool uses them. They are lent as empty modules for that import
    only, then dropped from sys.modules, so nothing else sees them."""

    NAMES = ("torchvision", "gguf")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> Any:
        return _Absent(spec.name)

    def exec_module(self, module: Any) -> None:
        module.__path__ = []


_finder = _LendAbsent()
sys.meta_path.append(_finder)
try:
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel
finally:
    sys.meta_path.remove(_finder)
    for _name in [n for n in sys.modules if n.split(".")[0] in _LendAbsent.NAMES]:
        if isinstance(sys.modules[_name], _Absent):
            del sys.modules[_name]

PAGE = 16  # tokens per page: the test layouts' block_tokens
LAYERS = 2
# One page is 8 KiB in 2-byte dtypes for both: MHA 2 x 2 layers x 16 tokens x 2 heads x 32,
# MLA 2 layers x 16 tokens x (64 + 64).
MHA = {"head_num": 2, "head_dim": 32}
MLA = {"kv_lora_rank": 64, "qk_rope_head_dim": 64}
WAIT_S = 60.0


def layout_spec(dtype: str = "float16", model: str = "test") -> str:
    """The node layout whose pages are this rig's (``--layout``)."""
    return f"model={model},num_layers=2,kv_heads=2,head_dim=32,dtype={dtype},block_tokens=16"


def extra_config(node: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend_name": "kvcache",
        "module_path": "clients.sglang_hicache",
        "class_name": "KVCacheHiCacheStorage",
        "node": node,
        "interface_v1": 1,
        **extra,
    }


def _mha(dtype: torch.dtype, layout: str) -> tuple[Any, Any]:
    kv = MHATokenToKVPool(
        128, PAGE, dtype, MHA["head_num"], MHA["head_dim"], LAYERS, "cpu", False,
        start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    host = MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device_capacity_tokens=kv.size, start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    return kv, host


def _mla(dtype: torch.dtype, layout: str) -> tuple[Any, Any]:
    kv = MLATokenToKVPool(
        128, PAGE, dtype, MLA["kv_lora_rank"], MLA["qk_rope_head_dim"], LAYERS, "cpu", False,
        start_layer=0, end_layer=LAYERS,
    )  # fmt: skip
    host = MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device_capacity_tokens=kv.size, start_layer=0, end_layer=LAYERS,
        target_layer_num=LAYERS,
    )  # fmt: skip
    return kv, host


@dataclass
class Rank:
    ctl: Any  # HybridCacheController
    host: Any  # the KV host pool
    group: Any  # HostPoolGroup
    _rid: list[int] = field(default_factory=lambda: [0])

    @property
    def backend(self) -> Any:
        return self.ctl.storage_backend

    def backup(
        self, tokens: list[int], seed: int, first_page: int = 0
    ) -> tuple[int, list[torch.Tensor]]:
        """Pages of random KV for ``tokens`` (from page ``first_page`` on) written to the host
        pool, then backed up to L3 by the controller's backup thread: (tokens it stored, the
        pages)."""
        names = get_storage_hash_str(tokens, None, page_size=PAGE)[first_page:]
        n = len(names)
        indices = self.group.alloc(n * PAGE)
        g = torch.Generator().manual_seed(seed)
        pages = []
        for i in range(n):
            start = int(indices[i * PAGE])
            page = torch.randn(self.host.get_dummy_flat_data_page().shape, generator=g)
            self.host.set_from_flat_data_page(start, page.to(self.host.dtype))
            pages.append(self.host.get_data_page(start, flat=True).clone())
        op_id = self.ctl.write_storage(indices, tokens[first_page * PAGE :], hash_value=names)
        op = self.ctl.ack_backup_queue.get(timeout=WAIT_S)
        assert op.id == op_id
        self.group.free(indices)
        return op.completed_tokens, pages

    def prefetch(self, tokens: list[int]) -> tuple[int, int, list[torch.Tensor]]:
        """A prefetch as the scheduler runs it: the controller's hit query, host memory for the
        hits, the controller's load, its acks. (hit tokens, loaded tokens, the loaded pages)."""
        self._rid[0] += 1
        op = self.ctl.prefetch(CacheRequestHandle(f"r{self._rid[0]}", 0), tokens)
        hit = self.ctl.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit is op
        hits = op.storage_hit_count
        if hits == 0:
            return 0, 0, []
        indices = self.group.alloc(hits)
        op.host_indices = indices
        self.ctl.prefetch_buffer.put(op)
        loaded = 0
        while True:
            ack = self.ctl.ack_prefetch_queue.get(timeout=WAIT_S)
            if ack.completed_tokens is not None:
                loaded = max(loaded, ack.completed_tokens)
            if ack.completed_req:
                break
        pages = [
            self.host.get_data_page(int(indices[i * PAGE]), flat=True).clone()
            for i in range(loaded // PAGE)
        ]
        self.group.free(indices)
        return hits, loaded, pages

    def close(self) -> None:
        self.ctl.detach_storage_backend()


def rank(
    node: str,
    *,
    mla: bool = False,
    dtype: torch.dtype = torch.float16,
    layout: str = "page_first",
    tp: tuple[int, int] = (0, 1),
    pp: tuple[int, int] = (0, 1),
    model: str = "test",
    swa: bool = False,
    metrics: bool = False,
    **extra: Any,
) -> Rank:
    """One scheduler's HiCache storage side, attached to the node at ``node``; ``swa``: a model
    with a sliding-window pool besides its KV (as SGLang's hybrid SWA stack registers it)."""
    with get_parallel().override(
        attn_dcp_size=1, attn_dcp_rank=0, tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1]
    ):
        kv, host = (_mla if mla else _mha)(dtype, layout)
        mapping = {i: i for i in range(LAYERS)}
        entries = [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=host,
                device_pool=kv,
                layer_mapping=mapping,
                transfer_layer_id_max=LAYERS,
                is_anchor=True,
            )  # fmt: skip
        ]
        if swa:
            swa_kv, swa_host = _mha(dtype, layout)
            entries.append(
                build_pool_entry(
                    name=PoolName.SWA,
                    host_pool=swa_host,
                    device_pool=swa_kv,
                    layer_mapping=mapping,
                    transfer_layer_id_max=LAYERS,
                )  # fmt: skip
            )
        group = HostPoolGroup(entries)
        allocator = PagedTokenToKVPoolAllocator(kv.size, PAGE, dtype, "cpu", kv, False)
        ctl = HybridCacheController(
            allocator, group, PAGE, None, load_cache_event=threading.Event(),
            io_backend="direct", transfer_layer_id_max=LAYERS, enable_storage_metrics=metrics,
        )  # fmt: skip
        # The attach the engine makes at start (and SGLang's attach API at run time).
        try:
            ctl.attach_storage_backend(
                storage_backend="dynamic", model_name=model,
                storage_backend_extra_config=extra_config(node, **extra), host_pools=entries,
            )  # fmt: skip
        except BaseException:
            ctl.detach_storage_backend()  # its threads, when it got that far
            raise
    return Rank(ctl, host, group)


def tokens(n_pages: int, salt: int = 0) -> list[int]:
    return [salt * 100_000 + i for i in range(n_pages * PAGE)]
