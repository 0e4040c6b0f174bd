"""The store's key index: 16-byte block key -> int handle (``tier | slot << 2``, see ``blocks``).

``KeyIndex`` from ``kvstore/_native.c`` is one flat open-addressing table sized once for the
store's pages (20 bytes per entry, load <= 0.8), where a dict of bytes keys to ints costs ~120
bytes per key; its probes start at a hash of the key seeded per process, so clients that choose
their keys cannot choose collisions. ``DictIndex`` is its twin in Python, used where the C module
is not built; the tests run both through the same operations.
"""

from __future__ import annotations

import os
from array import array
from typing import Iterable, Protocol, Sequence


class Index(Protocol):
    """What the store needs of its index. Values are ints in [0, 2**31); -1 means absent."""

    def get(self, key: bytes, default: int = -1, /) -> int: ...
    def put(self, key: bytes, value: int, /) -> None: ...
    def pop(self, key: bytes, default: int = -1, /) -> int: ...
    def get_many(self, keys: Sequence[bytes], stop_at_miss: bool = False, /) -> list[int]: ...
    def find_prefix(self, keys: Sequence[bytes], /) -> bytes: ...
    def items(self) -> list[tuple[bytes, int]]: ...
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, key: object, /) -> bool: ...

    @property
    def capacity(self) -> int: ...


class DictIndex:
    """``KeyIndex`` in Python (a dict): same behaviour, more memory per key."""

    def __init__(self, capacity: int, seed: int = 0) -> None:
        if not 0 <= capacity <= 1 << 40:
            raise ValueError("capacity must be within [0, 2**40]")
        self._d: dict[bytes, int] = {}
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        return self._capacity

    def get(self, key: bytes, default: int = -1, /) -> int:
        return self._d.get(_key(key), default)

    def put(self, key: bytes, value: int, /) -> None:
        key = _key(key)
        if not 0 <= value < 1 << 31:
            raise ValueError("a value must be within [0, 2**31)")
        if key not in self._d and len(self._d) >= self._capacity:
            raise OverflowError(f"KeyIndex is full ({self._capacity} keys)")
        self._d[key] = value

    def pop(self, key: bytes, default: int = -1, /) -> int:
        return self._d.pop(_key(key), default)

    def get_many(self, keys: Sequence[bytes], stop_at_miss: bool = False, /) -> list[int]:
        get = self._d.get
        out: list[int] = []
        for k in keys:
            v = get(_key(k), -1)
            if v < 0 and stop_at_miss:
                break
            out.append(v)
        return out

    def find_prefix(self, keys: Sequence[bytes], /) -> bytes:
        return array("i", self.get_many(keys, True)).tobytes()

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._d.items())

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, key: object, /) -> bool:
        return _key(key) in self._d  # type: ignore[arg-type]


def _key(key: bytes) -> bytes:
    if type(key) is bytes and len(key) == 16:
        return key
    b = bytes(key)
    if len(b) != 16:
        raise ValueError(f"a key is 16 bytes, got {len(b)}")
    return b


_CKeyIndex: type | None
try:
    from ._native import KeyIndex as _CKeyIndex
except ImportError:  # pragma: no cover - depends on the build
    _CKeyIndex = None

INDEX_IMPL = "C" if _CKeyIndex is not None else "Python"


def make_index(capacity: int) -> Index:
    seed = int.from_bytes(os.urandom(8), "little")
    if _CKeyIndex is not None:
        return _CKeyIndex(capacity, seed)  # type: ignore[no-any-return]
    return DictIndex(capacity, seed)


def implementations() -> Iterable[type]:
    """Every index class this build has (for the tests)."""
    yield DictIndex
    if _CKeyIndex is not None:
        yield _CKeyIndex
