"""specmesh.kv.GrowingLayer: a session's cache appended in place, cropped by a view, the same
entries as transformers' DynamicLayer (which copies the whole cache on every step)."""
from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from specmesh.kv import CACHE_GROWTH, GrowingLayer


def _steps():
    gen = torch.Generator().manual_seed(0)
    # (tokens appended, tokens cropped after): a prefill, verify steps with rejections, a long feed
    plan = [(5, 0), (4, 2), (1, 0), (9, 7), (3, 1), (CACHE_GROWTH + 10, 0), (2, 1)]
    for added, cropped in plan:
        yield torch.randn(1, 3, added, 8, generator=gen), torch.randn(1, 3, added, 8, generator=gen), cropped


def test_the_same_entries_as_dynamic_layer_through_appends_and_crops():
    growing, stock = GrowingLayer(), DynamicLayer()
    for keys, values, cropped in _steps():
        got, expected = growing.update(keys, values), stock.update(keys, values)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        if cropped:
            growing.crop(-cropped)
            stock.crop(-cropped)
        assert growing.get_seq_length() == stock.get_seq_length()
        assert torch.equal(growing.keys, stock.keys) and torch.equal(growing.values, stock.values)


def test_a_step_writes_in_place_until_the_buffer_is_full():
    layer = GrowingLayer()
    layer.update(torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    buffer = layer.keys._base
    assert buffer.shape[-2] == CACHE_GROWTH                     # room beyond the 3 filled positions
    layer.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4))
    assert layer.keys._base is buffer and layer.get_seq_length() == 5   # no copy of the cache
    layer.update(torch.ones(1, 2, CACHE_GROWTH, 4), torch.ones(1, 2, CACHE_GROWTH, 4))
    assert layer.keys._base is not buffer                       # full: a bigger buffer, the entries kept
    assert layer.get_seq_length() == 5 + CACHE_GROWTH and bool((layer.keys == 1).all())


def test_tensors_put_there_by_someone_else_are_copied_not_overwritten():
    layer = GrowingLayer()
    layer.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    foreign = torch.full((1, 1, 2, 4), 7.0)
    layer.keys = layer.values = foreign                         # as batch_select_indices would
    layer.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    assert bool((foreign == 7).all()) and layer.get_seq_length() == 3
