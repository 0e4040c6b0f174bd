"""Turning caller payloads (bytes, numpy, torch) into flat uint8 views, and copying bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeAlias

import numpy as np
import numpy.typing as npt
import xxhash

from .errors import InvalidArgument

_copy_hash_c: Callable[[Any, Any], int] | None
# PageHasher(n): a streaming xxh3-64 per page, for writers that fill pages a layer at a time and
# send the checksums with their Commit (None without the C module: the node hashes at commit).
PageHasher: type[_PageHasher] | None
try:  # copy and checksum in one pass (kvstore/_native.c), built where a compiler is
    from ._native import COPY_HASH_ISA, PageHasher
    from ._native import copy_hash as _copy_hash_c
except ImportError:  # pragma: no cover - depends on the build
    _copy_hash_c, COPY_HASH_ISA, PageHasher = None, "", None
# What copy_checksum runs, for benchmarks to print.
COPY_HASH_IMPL = f"C, {COPY_HASH_ISA}" if _copy_hash_c is not None else "Python"


if TYPE_CHECKING:
    import torch

    from ._native import PageHasher as _PageHasher

# A page's bytes as a flat uint8 view: numpy on the host, a torch tensor on its own device.
ByteView: TypeAlias = "npt.NDArray[np.uint8] | torch.Tensor"


def _is_torch(x: object) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def _check_dtype(data: Any, dtype_name: str | None, what: str) -> None:
    """A typed array or tensor must be in the layout dtype; raw uint8 is always accepted."""
    if not dtype_name:
        return
    if _is_torch(data):
        name = str(data.dtype).removeprefix("torch.")
        ok = name in ("uint8", dtype_name)
    else:
        name = data.dtype.name
        ok = name == "uint8" or _np_matches(data.dtype, dtype_name)
    if not ok:
        raise InvalidArgument(f"{what} dtype {name} does not match the layout dtype {dtype_name}")


def as_uint8(
    data: Any, expected_bytes: int, dtype_name: str | None = None, what: str = "payload"
) -> ByteView:
    """A flat uint8 view of ``data`` (numpy array, or torch tensor on its own device).

    ``dtype_name``: the layout dtype; typed arrays must match it (raw uint8 / bytes are accepted).
    """
    if _is_torch(data):
        _check_dtype(data, dtype_name, what)
        import torch

        tensor = data.detach().contiguous().reshape(-1).view(torch.uint8)
        flat: ByteView = tensor.numpy() if tensor.device.type == "cpu" else tensor
    elif isinstance(data, np.ndarray):
        _check_dtype(data, dtype_name, what)
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        try:
            flat = np.frombuffer(data, dtype=np.uint8)
        except TypeError:
            raise InvalidArgument(
                f"{what} must be bytes, a numpy array or a torch tensor, got {type(data).__name__}"
            ) from None
    if flat.shape[0] != expected_bytes:
        raise InvalidArgument(f"{what} is {flat.shape[0]} bytes; expected {expected_bytes}")
    return flat


def as_uint8_rows(
    data: Any, rows: int, row_bytes: int, dtype_name: str | None = None, what: str = "payload"
) -> ByteView:
    """``data`` as ``[rows, row_bytes]`` uint8 (numpy on the host, torch on a device).

    ``data``: a numpy array or torch tensor whose first axis has ``rows`` entries (one per page),
    or bytes. Rows need not follow each other in memory (one layer's slices of a batch of pages
    are ``row_bytes`` apart from a page's length): no copy is made while each row is contiguous.
    """
    if isinstance(data, (bytes, bytearray, memoryview)) or not (
        _is_torch(data) or isinstance(data, np.ndarray)
    ):
        return as_uint8(data, rows * row_bytes, dtype_name, what).reshape(rows, row_bytes)
    if data.ndim == 0 or data.shape[0] != rows:
        raise InvalidArgument(
            f"{what} has shape {tuple(data.shape)}; expected {rows} rows (one per page)"
        )
    _check_dtype(data, dtype_name, what)
    if _is_torch(data):
        import torch

        t = data.detach().reshape(rows, -1)
        if t.shape[1] and t.stride(1) != 1:
            t = t.contiguous()
        t = t.view(torch.uint8)
        out: ByteView = t.numpy() if t.device.type == "cpu" else t
    else:
        a = data.reshape(rows, -1)  # NOTE: a view unless rows are not contiguous (then a copy)
        if a.shape[1] and a.strides[1] != a.itemsize:
            a = np.ascontiguousarray(a)
        out = a.view(np.uint8)
    if out.shape[1] != row_bytes:
        raise InvalidArgument(f"{what} rows are {out.shape[1]} bytes; expected {row_bytes}")
    return out


def _np_matches(dt: np.dtype[Any], dtype_name: str) -> bool:
    if dtype_name in ("bfloat16",):  # numpy has no bf16: carried as uint16
        return dt == np.uint16
    if dtype_name.startswith("float8"):
        return dt == np.uint8
    return dt.name == dtype_name


def copy_bytes(dst: Any, src: Any) -> None:
    """Copy flat uint8 ``src`` into flat uint8 ``dst``; each may be numpy or torch (any device)."""
    if _is_torch(dst) or _is_torch(src):
        import torch

        if not _is_torch(dst):
            dst = torch.from_numpy(dst)
        if not _is_torch(src):
            src = torch.from_numpy(np.asarray(src))
        dst.copy_(src, non_blocking=False)
    else:
        np.copyto(dst, src, casting="no")


def copy_checksum(dst: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8]) -> int:
    """Copy flat uint8 ``src`` into flat uint8 ``dst`` (host arrays of one size) and return the
    pages' checksum of the bytes copied (xxh3-64), reading ``src`` from memory once: the C loop
    hashes each chunk right after its copy (kvstore/_copy_hash.h); the Python twin copies, then
    hashes ``dst`` from cache (0.75-0.80x memcpy on 1 MiB pages, the C loop 0.90-0.99x)."""
    if dst.shape != src.shape:
        raise InvalidArgument(f"copy of {src.shape} into {dst.shape}")
    if _copy_hash_c is not None and dst.flags.c_contiguous and src.flags.c_contiguous:
        return _copy_hash_c(dst, src)
    np.copyto(dst, src, casting="no")
    return xxhash.xxh3_64_intdigest(dst.data)


class LayerChecksums:
    """The checksums of pages written a layer at a time (layer-major pages: layer ``l`` is bytes
    ``[l * layer_bytes, (l + 1) * layer_bytes)``), taken as the writer goes: ``layer(l)`` right
    after layer ``l``'s slices were copied into ``pages`` hashes them from cache (a ``PageHasher``
    state per page). Layers must come in order; one out of order gives the checksums up, and the
    node then hashes the pages at commit. One writer thread at a time."""

    def __init__(self, pages: Sequence[npt.NDArray[np.uint8]], layer_bytes: int) -> None:
        assert PageHasher is not None  # make() says when there is none
        self._hasher: _PageHasher | None = PageHasher(len(pages))
        self._pages, self._layer_bytes = list(pages), layer_bytes
        self._layers = 0  # layers hashed so far

    @classmethod
    def make(
        cls, pages: Sequence[npt.NDArray[np.uint8]], layer_bytes: int
    ) -> LayerChecksums | None:
        """None without the C module (the node hashes the pages at commit)."""
        return cls(pages, layer_bytes) if PageHasher is not None else None

    def layer(self, layer: int) -> None:
        if self._hasher is None:
            return
        if layer != self._layers:
            self._hasher = None
            return
        self._hasher.update(self._pages, layer * self._layer_bytes, self._layer_bytes)
        self._layers += 1

    def copies(
        self, layer: int, runs: Sequence[Sequence[tuple[npt.NDArray[Any], npt.NDArray[Any]]]]
    ) -> bool:
        """Copy layer ``layer`` into the pages and hash it in the same pass (``PageHasher.
        copy_update``: each chunk hashed from L1 right after its copy, where ``layer`` would
        read the layer back). ``runs``: per run of pages, in the pages' order and covering
        them all, its (dst, src) parts in the pages' byte order (K slices, then V), each
        ``[pages of the run, ...]`` with every ``[i]`` contiguous. False, with nothing copied,
        when it cannot (a layer out of order, or rows that are not contiguous: an HF tensor's
        blocks): the caller copies, then calls ``layer``."""
        if self._hasher is None or layer != self._layers:
            return False
        pages = 0
        for parts in runs:
            n = len(parts[0][0]) if parts else 0
            if not n or sum(d[0].nbytes for d, _ in parts) != self._layer_bytes:
                return False
            for d, s in parts:
                if len(d) != n or len(s) != n or d[0].nbytes != s[0].nbytes:
                    return False
                if not (d[0].flags.c_contiguous and s[0].flags.c_contiguous):
                    return False
            pages += n
        if pages != len(self._pages):
            return False
        first = 0
        for parts in runs:
            for d, s in parts:
                self._hasher.copy_update(first, d, s)
            first += len(parts[0][0])
        self._layers += 1
        return True

    def sums(
        self, keys: int, index: Sequence[int], num_layers: int
    ) -> npt.NDArray[np.uint64] | None:
        """A commit's checksums, one per key of its lease: page ``i`` of ``pages`` is key
        ``index[i]``'s, 0 for the keys written by no one; None unless all ``num_layers`` layers
        were hashed, in order."""
        if self._hasher is None or self._layers != num_layers:
            return None
        out = np.zeros(keys, dtype=np.uint64)
        out[list(index)] = self._hasher.digests()
        return out
