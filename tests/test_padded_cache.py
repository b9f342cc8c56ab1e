"""The padded KV cache (specmesh/padded_cache.py): the batch-invariant attention sees its keys padded to a
multiple of KEY_BUCKET, and every logit keeps the bits it has with transformers' own cache; the padding
stays zero through crops, tree moves and batching."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specmesh import kv, padded_cache
from specmesh.padded_cache import KEY_BUCKET, PaddedLayer, new_cache
from tests.test_invariant import _batched, _llama, _prefill, _steps, _tree_steps, models  # noqa: F401


def _stock_cache(monkeypatch):
    """Every cache the services build is transformers' DynamicCache again: keys exactly as long as held."""
    stock = lambda config: DynamicCache(config=config)   # noqa: E731
    monkeypatch.setattr(kv, "new_cache", stock)
    import verifier_service.batching as batching

    monkeypatch.setattr(batching, "new_cache", stock)


@pytest.mark.parametrize("run", [_prefill, _steps, _tree_steps, _batched],
                         ids=["prefill", "steps", "tree-steps", "batched"])
def test_padded_keys_give_the_bits_of_unpadded_ones(models, monkeypatch, run):   # noqa: F811
    _, model = models
    padded = run(model)
    _stock_cache(monkeypatch)
    assert torch.equal(run(model), padded)


def test_the_invariant_models_sessions_hold_padded_layers_and_others_keep_transformers_cache(models):  # noqa: F811
    stock, invariant = models
    session = kv.KVSession("a", invariant)
    assert all(type(layer) is PaddedLayer for layer in session.cache.layers)
    assert all(type(layer) is DynamicLayer for layer in kv.KVSession("b", stock).cache.layers)


def _kv(tokens: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((1, 2, tokens, 4), fill), torch.full((1, 2, tokens, 4), -fill)


def test_a_layer_returns_a_bucket_of_keys_zero_past_those_held_through_growth_crops_and_replacement():
    layer = PaddedLayer()
    keys, values = layer.update(*_kv(KEY_BUCKET - 2, 1.0))
    assert keys.shape[-2] == values.shape[-2] == KEY_BUCKET and layer.get_seq_length() == KEY_BUCKET - 2
    assert keys[..., KEY_BUCKET - 2:, :].eq(0).all() and values[..., :KEY_BUCKET - 2, :].eq(-1).all()

    keys, _ = layer.update(*_kv(5, 2.0))                       # grows into a second bucket, keeping the first
    assert keys.shape[-2] == 2 * KEY_BUCKET and layer.get_seq_length() == KEY_BUCKET + 3
    assert keys[..., :KEY_BUCKET - 2, :].eq(1).all() and keys[..., KEY_BUCKET - 2:KEY_BUCKET + 3, :].eq(2).all()

    layer.crop(-4)                                             # rejected drafts: their entries become zeros
    assert layer.get_seq_length() == KEY_BUCKET - 1 and layer.keys.shape[-2] == KEY_BUCKET - 1
    keys, values = layer.update(*_kv(1, 3.0))
    assert keys.shape[-2] == KEY_BUCKET
    assert keys[..., KEY_BUCKET - 1, :].eq(3).all() and values[..., KEY_BUCKET:, :].sum() == 0
    assert layer._key_buffer[..., KEY_BUCKET:, :].eq(0).all()   # the crop's zeros, in the grown capacity too

    layer.keys, layer.values = _kv(3, 7.0)                     # replaced from outside (not views of the buffers)
    keys, _ = layer.update(*_kv(1, 8.0))
    assert layer.get_seq_length() == 4 and keys.shape[-2] == KEY_BUCKET
    assert keys[..., :3, :].eq(7).all() and keys[..., 3, :].eq(8).all() and keys[..., 4:, :].eq(0).all()


def test_new_cache_pads_only_under_the_batch_invariant_attention():
    model = _llama(kv_heads=2)
    assert all(type(layer) is DynamicLayer for layer in new_cache(model.config).layers)
    model.config._attn_implementation = padded_cache.ATTENTION
    assert all(type(layer) is PaddedLayer for layer in new_cache(model.config).layers)
