"""The emulated engines' synthetic pages (``bench live``): what ``SyntheticKV`` writes is the
documented pattern, and ``matches`` catches a page of another key, layer or a flipped byte."""

from __future__ import annotations

import numpy as np
import pytest

from bench.replay.live_engine import SyntheticKV
from node.config import parse_layout

LAYOUTS = [
    "model=demo,num_layers=4,kv_heads=1,head_dim=32,dtype=float16,block_tokens=512",
    # 12-byte layers: no whole repeat of the 16-byte key fits in a layer
    "model=odd,num_layers=3,kv_heads=1,head_dim=1,dtype=float16,block_tokens=3",
]


def documented(key: bytes, layers: int, layer_bytes: int) -> np.ndarray:
    """Layer l: the key repeated over the layer, each byte XOR (l * 37 + 1) & 255."""
    tiled = np.resize(np.frombuffer(key, np.uint8), layer_bytes)
    return np.concatenate([tiled ^ np.uint8((l * 37 + 1) & 0xFF) for l in range(layers)])


@pytest.mark.parametrize("spec", LAYOUTS)
def test_fill_writes_the_documented_pattern_and_matches_checks_every_byte(spec):
    layout = parse_layout(spec)
    kv = SyntheticKV(layout)
    key, other = bytes(range(1, 17)), bytes(range(2, 18))
    page = np.zeros(layout.page_bytes, np.uint8)
    kv.fill(page, key)
    assert np.array_equal(page, documented(key, layout.num_layers, layout.layer_bytes))
    assert kv.matches(page, key) and not kv.matches(page, other)
    assert not kv.matches(page[:-1], key)  # wrong size
    for pos in (0, layout.layer_bytes - 1, layout.page_bytes - 1):
        bad = page.copy()
        bad[pos] ^= 1
        assert not kv.matches(bad, key)
    swapped = page.reshape(layout.num_layers, -1)[::-1].reshape(-1).copy()
    assert not kv.matches(swapped, key)  # layers in the wrong order
