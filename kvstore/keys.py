"""Chained 128-bit block keys.

``key_i = xxh3_128(key_{i-1} || token_ids_i)`` with ``key_{-1}`` a root derived from the namespace
(model layout fingerprint) and the cache salt (tenant). A key names a whole prefix: equal keys mean
equal prefixes. Deterministic across processes and machines (never Python's ``hash``).
Token ids are hashed as little-endian uint32.
"""

from __future__ import annotations

from typing import Any, Callable, NewType, Sequence, cast

import numpy as np
import numpy.typing as npt
import xxhash

from .errors import InvalidArgument

_chain_c: Callable[[Any, int, bytes], list[bytes]] | None
_split_c: Callable[[bytes, int], list[bytes]] | None
_scope_c: Callable[[Sequence[bytes], bytes], list[bytes]] | None
try:  # the per-key loops in C (kvstore/_native.c), built with the package where a compiler is
    from ._native import chain as _chain_c
    from ._native import scope as _scope_c
    from ._native import split as _split_c
except ImportError:  # pragma: no cover - depends on the build
    _chain_c = _split_c = _scope_c = None

BlockKey = NewType("BlockKey", bytes)
KEY_BYTES = 16
_ROOT_DOMAIN = b"kvcache/root/v1\x00"
_TOKEN_DTYPE = np.dtype("<u4")
_KEY_DTYPE = np.dtype(f"V{KEY_BYTES}")


def root_key(namespace: str, salt: bytes | str = b"") -> BlockKey:
    """The parent of a prefix's first block: namespace and salt isolate key spaces."""
    if isinstance(salt, str):
        salt = salt.encode()
    ns = namespace.encode()
    payload = _ROOT_DOMAIN + len(ns).to_bytes(4, "little") + ns + salt
    return BlockKey(xxhash.xxh3_128_digest(payload))


def tokens_as_array(tokens: Any) -> npt.NDArray[np.uint32]:
    """Token ids (list, numpy array or torch tensor) as a contiguous little-endian uint32 array."""
    if hasattr(tokens, "detach"):  # torch tensor: one host copy, no per-token work
        tokens = tokens.detach().reshape(-1).cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype != _TOKEN_DTYPE:
        if arr.dtype.kind == "i" and arr.min() < 0:
            raise InvalidArgument("token ids must be non-negative")
        if arr.max() > 0xFFFFFFFF:
            raise InvalidArgument("token ids must fit in 32 bits")
        arr = arr.astype(_TOKEN_DTYPE)
    return np.ascontiguousarray(arr, dtype=_TOKEN_DTYPE)


def block_keys(
    tokens: Any, block_tokens: int, root: bytes, parent: bytes | None = None
) -> list[BlockKey]:
    """Keys of every full block of ``tokens``; a trailing partial block is not keyed.

    ``parent`` continues an existing chain (default: ``root``). Cost: one hash call per block over
    the raw token bytes, in C where ``kvstore._native`` is built (``CHAIN_IMPL`` says which).
    """
    if block_tokens <= 0:
        raise InvalidArgument("block_tokens must be positive")
    arr = tokens_as_array(tokens)
    prev = parent if parent is not None else root
    if _chain_c is not None:
        return cast(list[BlockKey], _chain_c(arr, block_tokens * _TOKEN_DTYPE.itemsize, prev))
    return _block_keys_py(arr, block_tokens, prev)


def _block_keys_py(arr: npt.NDArray[np.uint32], block_tokens: int, prev: bytes) -> list[BlockKey]:
    """The same chain in Python: the reference the C loop is tested against."""
    n_blocks = arr.size // block_tokens
    data = arr[: n_blocks * block_tokens].tobytes()
    step = block_tokens * _TOKEN_DTYPE.itemsize
    digest = xxhash.xxh3_128_digest
    keys: list[bytes] = []
    append = keys.append
    for off in range(0, n_blocks * step, step):
        prev = digest(prev + data[off : off + step])  # NOTE: one call beats hasher + update
        append(prev)
    return cast(list[BlockKey], keys)  # NOTE: no per-key BlockKey() call on this hot loop


CHAIN_IMPL = "C" if _chain_c is not None else "Python"


def keys_from_block_ids(block_ids: Sequence[int], root: bytes) -> list[BlockKey]:
    """Chained keys for a trace's per-block ids (Mooncake traces give one id per 512-token
    block)."""
    arr = np.asarray(block_ids, dtype="<i8")
    data = arr.tobytes()
    prev = root
    keys: list[bytes] = []
    for off in range(0, len(data), 8):
        prev = xxhash.xxh3_128_digest(prev + data[off : off + 8])
        keys.append(prev)
    return cast(list[BlockKey], keys)


def check_keys(keys: Sequence[bytes]) -> list[BlockKey]:
    """Validate a batch of keys at an API boundary: 16-byte ``bytes`` each."""
    out: list[BlockKey] = []
    for i, k in enumerate(keys):
        if type(k) is bytes and len(k) == KEY_BYTES:
            out.append(k)  # type: ignore[arg-type]  # NOTE: the common case, no copy or call
            continue
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise InvalidArgument(
                f"key #{i} must be {KEY_BYTES} bytes, got "
                f"{type(k).__name__} of length {len(k) if hasattr(k, '__len__') else '?'}"
            )
        out.append(BlockKey(bytes(k)))
    return out


def scope_keys(keys: Sequence[bytes], tenant: str) -> list[BlockKey]:
    """Keys as stored for an authenticated tenant: ``xxh3_128(tenant-domain || key)``.

    Servers apply this to every key a tenant sends or derives, so one tenant can never name
    another's blocks even if it learns their salt. Tenant ``""`` (auth off, or the admin token)
    is the identity.
    """
    if not tenant:
        return list(keys)  # type: ignore[arg-type]
    return derive_keys(keys, b"kvcache/tenant/" + tenant.encode() + b"\x00")


def derive_keys(keys: Sequence[bytes], prefix: bytes) -> list[BlockKey]:
    """``xxh3_128(prefix || key)`` for every key: a key space derived from another one, e.g. a
    tenant's (``scope_keys``) or one rank's share of an engine's pages."""
    if _scope_c is not None:
        try:
            return cast(list[BlockKey], _scope_c(keys, prefix))
        except ValueError:
            pass  # not all 16-byte bytes objects: the loop below takes any bytes-like key
    digest = xxhash.xxh3_128_digest
    return [BlockKey(digest(prefix + k)) for k in keys]


def split_keys(key_bytes: bytes) -> list[BlockKey]:
    """Packed keys (16 bytes each, back to back) as a list of keys."""
    if len(key_bytes) % KEY_BYTES:
        raise InvalidArgument(
            f"key_bytes must hold {KEY_BYTES}-byte keys back to back, got {len(key_bytes)} bytes"
        )
    if _split_c is not None:
        return cast(list[BlockKey], _split_c(key_bytes, KEY_BYTES))
    # NOTE: numpy's 16-byte void items come back as bytes, none stripped, ~4x faster than slicing
    # in a comprehension.
    return np.frombuffer(key_bytes, dtype=_KEY_DTYPE).tolist()  # type: ignore[no-any-return]


def select_keys(
    namespace: str,
    salt: bytes | str,
    block_tokens: int,
    max_blocks: int,
    keys: Sequence[bytes] = (),
    token_ids: Sequence[int] = (),
    token_bytes: bytes = b"",
    key_bytes: bytes = b"",
) -> tuple[list[BlockKey], int]:
    """Resolve a request's blocks, named by keys (a list, or packed 16-byte keys) or by token ids
    (a list, or packed little-endian uint32 bytes), into their keys and the number of prompt
    tokens they stand for. The one resolution every server uses (node and conductor); at most
    ``max_blocks`` blocks."""
    given = (len(keys) > 0) + (len(token_ids) > 0) + (len(token_bytes) > 0) + (len(key_bytes) > 0)
    if given > 1:
        raise InvalidArgument("give one of keys, key_bytes, token_ids or token_bytes, not several")
    if token_bytes:
        if len(token_bytes) % 4:
            raise InvalidArgument(
                "token_bytes must hold little-endian uint32 token ids "
                f"(a multiple of 4 bytes), got {len(token_bytes)} bytes"
            )
        token_ids = np.frombuffer(token_bytes, dtype=_TOKEN_DTYPE)  # type: ignore[assignment]
    if len(token_ids):
        if len(token_ids) > max_blocks * block_tokens:
            raise InvalidArgument("too many token ids in one request")
        return block_keys(token_ids, block_tokens, root_key(namespace, salt)), len(token_ids)
    if key_bytes:
        if len(key_bytes) > max_blocks * KEY_BYTES:
            raise InvalidArgument(
                f"{len(key_bytes) // KEY_BYTES} keys in one request; the limit is {max_blocks}"
            )
        raw = split_keys(key_bytes)
        return raw, len(raw) * block_tokens
    if len(keys) > max_blocks:
        raise InvalidArgument(f"{len(keys)} keys in one request; the limit is {max_blocks}")
    # Fast path: protobuf already gives bytes; only the length can be wrong.
    raw = (
        cast(list[BlockKey], list(keys))
        if all(map(KEY_BYTES.__eq__, map(len, keys)))
        else check_keys(keys)
    )
    return raw, len(raw) * block_tokens
