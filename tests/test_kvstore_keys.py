"""Block keys: the chained xxh3-128 of DESIGN.md, deterministic, isolated by namespace and salt."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
import xxhash

from kvstore import (
    InvalidArgument,
    KVLayout,
    block_keys,
    check_keys,
    keys_from_block_ids,
    root_key,
    scope_keys,
)
from kvstore import keys as keys_mod
from kvstore.keys import select_keys

from kvstore_helpers import LAYOUT, make_store, run_python

BT = 16  # block_tokens used by these tests


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 150_000, n, dtype=np.int64)


def test_first_keys_follow_the_documented_formula():
    toks = tokens(3 * BT)
    root = root_key("ns", b"salt")
    k = block_keys(toks, BT, root)
    raw = toks.astype("<u4").tobytes()
    step = BT * 4
    k0 = xxhash.xxh3_128_digest(root + raw[:step])
    k1 = xxhash.xxh3_128_digest(k0 + raw[step : 2 * step])
    assert k[:2] == [k0, k1]
    assert all(len(x) == 16 for x in k)
    assert len(set(k)) == 3


def test_keys_are_identical_in_another_process():
    toks = tokens(40 * BT + 3, seed=7)
    expected = [k.hex() for k in block_keys(toks, BT, root_key(LAYOUT.namespace, "tenant-a"))]
    code = (
        "import json, sys, numpy as np\n"
        "from kvstore import block_keys, root_key\n"
        "toks = json.loads(sys.argv[1])\n"
        "ks = block_keys(np.array(toks), int(sys.argv[2]), root_key(sys.argv[3], 'tenant-a'))\n"
        "print(json.dumps([k.hex() for k in ks]))\n"
    )
    # A different PYTHONHASHSEED proves no builtin hash() sneaks into the keys.
    for seed in ("1", "12345"):
        proc = run_python(
            code, json.dumps(toks.tolist()), str(BT), LAYOUT.namespace, env={"PYTHONHASHSEED": seed}
        )
        assert json.loads(proc.stdout) == expected


def test_salt_isolates_key_spaces():
    toks = tokens(4 * BT)
    plain = block_keys(toks, BT, root_key("ns"))
    a = block_keys(toks, BT, root_key("ns", b"tenant-a"))
    b = block_keys(toks, BT, root_key("ns", b"tenant-b"))
    assert a == block_keys(toks, BT, root_key("ns", "tenant-a"))  # str salt == its utf-8 bytes
    assert not set(a) & set(b) and not set(a) & set(plain) and not set(b) & set(plain)


@pytest.mark.parametrize(
    "field,value",
    [
        ("model", "other-model"),
        ("num_layers", 3),
        ("kv_heads", 4),
        ("head_dim", 8),
        ("dtype", "bfloat16"),
        ("block_tokens", 8),
    ],
)
def test_namespace_isolates_layouts(field, value):
    other = dataclasses.replace(LAYOUT, **{field: value})
    assert other.namespace != LAYOUT.namespace
    toks = tokens(4 * 8)
    ours = block_keys(toks, 8, root_key(LAYOUT.namespace))
    theirs = block_keys(toks, 8, root_key(other.namespace))
    assert not set(ours) & set(theirs)


def test_namespace_and_salt_do_not_run_into_each_other():
    # The namespace is length-prefixed, so moving bytes across the boundary changes the root.
    assert root_key("ab", b"c") != root_key("a", b"bc")


def test_list_numpy_and_torch_inputs_give_equal_keys():
    toks = tokens(5 * BT)
    root = root_key("ns")
    expected = block_keys(toks, BT, root)
    inputs = [
        toks.tolist(),
        toks.astype(np.int32),
        toks.astype(np.uint32),
        toks.astype(">u4"),
        torch.from_numpy(toks),
        torch.from_numpy(toks).to(torch.int32),
        toks.reshape(5, BT),
    ]
    for inp in inputs:
        assert block_keys(inp, BT, root) == expected, type(inp)


def test_partial_trailing_block_is_not_keyed():
    toks = tokens(3 * BT)
    root = root_key("ns")
    full = block_keys(toks, BT, root)
    assert block_keys(toks[: 3 * BT - 1], BT, root) == full[:2]
    assert block_keys(np.concatenate([toks, toks[: BT - 1]]), BT, root) == full
    assert block_keys(toks[: BT - 1], BT, root) == []
    assert block_keys([], BT, root) == []


def test_a_key_names_the_whole_prefix():
    toks = tokens(4 * BT)
    root = root_key("ns")
    base = block_keys(toks, BT, root)
    late = toks.copy()
    late[2 * BT + 5] += 1  # a change in block 2 leaves blocks 0 and 1 alone
    changed = block_keys(late, BT, root)
    assert changed[:2] == base[:2] and not set(changed[2:]) & set(base)
    early = toks.copy()
    early[0] += 1  # a change in block 0 changes every key after it
    assert not set(block_keys(early, BT, root)) & set(base)


def test_parent_continues_a_chain():
    toks = tokens(6 * BT)
    root = root_key("ns")
    whole = block_keys(toks, BT, root)
    head = block_keys(toks[: 2 * BT], BT, root)
    tail = block_keys(toks[2 * BT :], BT, root, parent=head[-1])
    assert head + tail == whole


@pytest.mark.parametrize(
    "bad",
    [
        [1, -1, 2],
        np.array([3, -5]),
        torch.tensor([-1, 2]),  # negative
        [1.0, 2.0],
        np.array([1.5]),
        torch.tensor([1.0, 2.0]),  # float
        [0, 2**32],
        np.array([2**40], dtype=np.int64),
        [2**70],  # too large
        np.array([True, False]),
        ["a", "b"],  # not integers at all
    ],
)
def test_bad_token_ids_raise_invalid_argument(bad):
    with pytest.raises(InvalidArgument):
        block_keys(bad, 1, root_key("ns"))


@pytest.mark.parametrize("block_tokens", [0, -4])
def test_block_tokens_must_be_positive(block_tokens):
    with pytest.raises(InvalidArgument, match="block_tokens"):
        block_keys([1, 2, 3], block_tokens, root_key("ns"))


def test_keys_from_block_ids_chain_like_token_keys():
    root = root_key("trace")
    ks = keys_from_block_ids([5, 9, 11], root)
    assert ks[:2] == keys_from_block_ids([5, 9], root)
    assert ks[0] == xxhash.xxh3_128_digest(root + (5).to_bytes(8, "little"))
    # the same block id under a different prefix is a different block
    assert keys_from_block_ids([7, 9], root)[1] != ks[1]
    assert keys_from_block_ids([5, 9], root_key("other"))[0] != ks[0]


def test_check_keys_rejects_malformed_keys():
    good = b"k" * 16
    assert check_keys([good, bytearray(good)]) == [good, good]
    for bad in (b"short", b"x" * 17, "s" * 16, 12345, None):
        with pytest.raises(InvalidArgument, match="key #1"):
            check_keys([good, bad])


@pytest.mark.skipif(
    keys_mod._chain_c is None,
    reason="kvstore._chain is not built (pip install -e . builds it where xxhash.h is installed)",
)
@pytest.mark.parametrize("block_tokens", [1, 7, 16, 256, 512])
def test_the_c_chain_gives_the_python_loops_keys(block_tokens):
    ts = tokens(40 * block_tokens + 5, seed=block_tokens)
    arr = keys_mod.tokens_as_array(ts)
    root = root_key("ns", b"s")
    assert keys_mod._chain_c(arr, block_tokens * 4, root) == keys_mod._block_keys_py(
        arr, block_tokens, root
    )
    parent = block_keys(ts[:block_tokens], block_tokens, root)[0]
    assert (
        block_keys(ts[block_tokens:], block_tokens, root, parent)
        == block_keys(ts, block_tokens, root)[1:]
    )
    assert keys_mod._chain_c(b"", 64, root) == []
    with pytest.raises(ValueError, match="16-byte key"):
        keys_mod._chain_c(arr, 64, b"short")
    with pytest.raises(ValueError, match="positive"):
        keys_mod._chain_c(arr, 0, root)


def test_every_form_of_a_selector_resolves_to_the_same_keys():
    ts = tokens(5 * BT + 3)
    want = block_keys(ts, BT, root_key("ns", b"salt"))
    forms = {
        "keys": {"keys": want},
        "key_bytes": {"key_bytes": b"".join(want)},
        "token_ids": {"token_ids": [int(t) for t in ts]},
        "token_bytes": {"token_bytes": ts.astype("<u4").tobytes()},
    }
    for name, form in forms.items():
        got, n_tokens = select_keys("ns", b"salt", BT, 64, **form)
        assert got == want, name
        assert n_tokens == (len(ts) if "token" in name else 5 * BT), name
    with pytest.raises(InvalidArgument, match="16-byte keys back to back"):
        select_keys("ns", b"", BT, 64, key_bytes=b"k" * 17)
    with pytest.raises(InvalidArgument, match="the limit is 4"):
        select_keys("ns", b"", BT, 4, key_bytes=b"k" * 16 * 5)
    with pytest.raises(InvalidArgument, match="not several"):
        select_keys("ns", b"", BT, 64, keys=want, key_bytes=b"".join(want))


def test_scope_keys_separates_tenants():
    ks = block_keys(tokens(3 * BT), BT, root_key("ns"))
    assert scope_keys(ks, "") == ks
    a, b = scope_keys(ks, "alice"), scope_keys(ks, "bob")
    assert a == scope_keys(ks, "alice")
    assert not set(a) & set(b) and not set(a) & set(ks)


def test_store_keys_for_uses_the_layout_namespace():
    store = make_store(dram_pages=1)
    try:
        toks = tokens(3 * LAYOUT.block_tokens + 1)
        assert store.keys_for(toks, "t") == block_keys(
            toks, LAYOUT.block_tokens, root_key(LAYOUT.namespace, "t")
        )
        other = KVLayout(model="other", num_layers=2, kv_heads=2, head_dim=4, block_tokens=4)
        assert not set(store.keys_for(toks)) & set(block_keys(toks, 4, root_key(other.namespace)))
    finally:
        store.close()


def test_keys_follow_the_algorithm_written_in_docs_api_md():
    """An implementation written from docs/api.md's "Block keys" text agrees with block_keys."""
    import struct

    ns, salt, bt = "llama3-8b|L32|H8|D128|bfloat16|B256", b"tenant-salt", 256
    tokens = list(range(1000, 1000 + 3 * bt + 17))

    def h(data: bytes) -> bytes:  # xxh3_128, seed 0, the 128-bit value big-endian
        return xxhash.xxh3_128_intdigest(data).to_bytes(16, "big")

    parent = h(b"kvcache/root/v1\x00" + struct.pack("<I", len(ns.encode())) + ns.encode() + salt)
    expected = []
    for i in range(len(tokens) // bt):
        parent = h(parent + struct.pack(f"<{bt}I", *tokens[i * bt : (i + 1) * bt]))
        expected.append(parent)
    assert block_keys(tokens, bt, root_key(ns, salt)) == expected
