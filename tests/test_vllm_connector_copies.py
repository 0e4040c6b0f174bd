"""The vLLM connector's row copies between vLLM's paged blocks and page rows: slices for runs,
indexed gathers for scattered rows, in words as wide as the rows allow; all byte-exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from clients.vllm_connector import _RowMap, _word_for  # noqa: E402

ROW_WORDS = 16


@st.composite
def row_pairs(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """Distinct page rows and distinct vLLM blocks, paired: sometimes runs, sometimes scattered."""
    n = draw(st.integers(0, 40))
    if draw(st.booleans()):  # runs, as vLLM's free-block queue hands out
        start_p, start_b = draw(st.integers(0, 20)), draw(st.integers(0, 20))
        pages, blocks = list(range(start_p, start_p + n)), list(range(start_b, start_b + n))
        cut = draw(st.integers(0, n))
        blocks = blocks[cut:] + blocks[:cut]  # two runs
    else:
        pages = draw(st.permutations(range(64)))[:n]
        blocks = draw(st.permutations(range(64)))[:n]
    return pages, blocks


@settings(max_examples=200, deadline=None)
@given(row_pairs(), st.integers(0, 3))
def test_row_copies_move_exactly_the_paired_rows(pairs, layer):
    pages, blocks = pairs
    offset = layer * 64
    rows = torch.from_numpy(np.random.default_rng(0).integers(0, 1 << 62, (4 * 64 + 64, ROW_WORDS)))
    vllm = torch.from_numpy(np.random.default_rng(1).integers(0, 1 << 62, (64, ROW_WORDS)))
    m = _RowMap(pages, blocks)

    want_vllm = vllm.clone()
    for p, b in zip(pages, blocks):
        want_vllm[b] = rows[offset + p]
    got = vllm.clone()
    m.to_blocks(rows, offset, got)
    assert torch.equal(got, want_vllm)

    want_rows = rows.clone()
    for p, b in zip(pages, blocks):
        want_rows[offset + p] = vllm[b]
    got_rows = rows.clone()
    m.to_pages(vllm, got_rows, offset)
    assert torch.equal(got_rows, want_rows)


def test_runs_copy_as_slices_and_scattered_rows_by_index():
    assert _RowMap(list(range(8, 56)), list(range(100, 148))).runs == [(8, 100, 48)]
    assert _RowMap(list(range(8, 56)), list(range(100, 148))).sliced
    scattered = _RowMap(list(range(48)), list(range(190, 94, -2)))
    assert not scattered.sliced


def test_word_is_the_widest_that_tiles_rows_and_addresses():
    assert _word_for(8192, [4096, 0]) == torch.int64
    assert _word_for(8192, [4100]) == torch.int32
    assert _word_for(6, [0]) == torch.int16
    assert _word_for(8192, [4097]) == torch.uint8
