"""The page layout of one model's KV cache.

A page holds one token block for all layers, layer-major:
``[layers][k|v][block_tokens][kv_heads][head_dim]``, so one layer's slice (K then V) is contiguous
and layer-wise store/load touches one range per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgument, echo

_DTYPES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


@dataclass(frozen=True, kw_only=True)
class KVLayout:
    """Model layout fingerprint and page geometry. Equal layouts share a namespace."""

    model: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    block_tokens: int = 256

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("layout.model must be a non-empty model name")
        for name in ("num_layers", "kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"layout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in _DTYPES:
            raise InvalidArgument(
                f"layout.dtype {echo(self.dtype)} is not supported; use one of {sorted(_DTYPES)}"
            )

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def kv_bytes(self) -> int:
        """Bytes of K (or V) for one layer of one block."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's slice of a page (K then V)."""
        return 2 * self.kv_bytes

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_offset(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise InvalidArgument(f"layer {layer} out of range [0, {self.num_layers})")
        return layer * self.layer_bytes

    @property
    def numpy_dtype(self) -> np.dtype:
        """A numpy dtype of the same item size (bf16/fp8 are carried as raw integers)."""
        if self.dtype in ("float16", "float32", "uint8", "int8"):
            return np.dtype(self.dtype)
        return np.dtype(np.uint16 if self.itemsize == 2 else np.uint8)

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_tokens, self.kv_heads, self.head_dim)

    @property
    def namespace(self) -> str:
        """The fingerprint that names this layout's key space."""
        return (
            f"{self.model}|L{self.num_layers}|H{self.kv_heads}|D{self.head_dim}"
            f"|{self.dtype}|B{self.block_tokens}"
        )

    def to_dict(self) -> dict[str, str | int]:
        return {
            "model": self.model,
            "num_layers": self.num_layers,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_tokens": self.block_tokens,
        }
