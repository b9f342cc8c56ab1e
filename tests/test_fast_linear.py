"""Pre-packed and int8 linear layers (specmesh.fast_linear, specmesh.quantize) on tiny models.

That the packed verifier gives the target's greedy output through the three
services is tests/test_greedy_equality.py (the verifier packs by default).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from specmesh.config import DraftConfig, VerifierConfig
from specmesh.fast_linear import PackedLinear, apply_kernels, pack_linears
from specmesh.kv import KVSession
from specmesh.models import load_model
from specmesh.quantize import quantize_linears


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (1, 1, 48), (2, 9, 48)])
def test_packed_linear_matches_linear(bias, shape):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    packed = PackedLinear(linear)
    x = torch.randn(*shape)
    with torch.inference_mode():
        assert torch.allclose(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed.weight is linear.weight


def test_packed_model_keeps_outputs_ties_and_state_dict(tiny_models):
    stock = load_model(str(tiny_models["target"])).model
    packed = load_model(str(tiny_models["target"])).model
    keys = set(packed.state_dict())
    assert pack_linears(packed) == sum(1 for m in stock.modules() if type(m) is nn.Linear)
    assert set(packed.state_dict()) == keys, "the packed copy must not change what the model saves"
    assert not any(type(m) is nn.Linear for m in packed.modules())
    ids = torch.randint(3, 40, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        a, b = stock(ids).logits, packed(ids).logits                  # [1, 30, V]
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_packed_kv_session_scores_a_verify_like_stock(tiny_models):
    """The verifier's path: a cached context, then 1 + k tokens in one forward."""
    models = [load_model(str(tiny_models["target"])).model for _ in range(2)]
    pack_linears(models[1])
    context = list(range(3, 40))
    logits = []
    for model in models:
        s = KVSession("s", model)
        s.sync(0, context)
        s.forward()
        logits.append(s.forward([5, 6, 7, 8]))                         # [5, V]
    assert torch.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_tied_head_stays_tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    pack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_packing_skips_what_it_does_not_apply_to():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.float64)
    assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear


def test_quantized_tiny_draft_still_predicts(tiny_models):
    stock = load_model(str(tiny_models["draft"])).model
    model = load_model(str(tiny_models["draft"])).model
    assert quantize_linears(model, "int8-dynamic") > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(3, 40, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        agree = (stock(ids).logits.argmax(-1) == model(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.8


def test_bad_kernel_names_are_refused():
    with pytest.raises(ValueError, match="linear_kernels must be one of"):
        VerifierConfig(linear_kernels="fast")
    with pytest.raises(ValueError, match="linear_kernels must be one of"):
        DraftConfig(linear_kernels="int4")
    with pytest.raises(ValueError, match="unknown linear kernels"):
        apply_kernels(nn.Linear(2, 2), "fast")


@pytest.mark.parametrize("shape", [(1, 48), (5, 48), (2, 9, 48)])
def test_bf16_packed_linear_is_a_rounded_linear(shape):
    """use_bf16: weights and inputs rounded to bfloat16, accumulated by oneDNN: close to fp32, and
    exactly F.linear of the rounded operands up to the accumulation order."""
    from specmesh.fast_linear import bf16_available

    if not bf16_available():
        pytest.skip("this CPU's oneDNN has no bfloat16 products")
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear)
    packed.use_bf16()
    x = torch.randn(*shape)
    with torch.inference_mode():
        got, exact = packed(x), linear(x)
        rounded = nn.functional.linear(x.bfloat16().float(), linear.weight.bfloat16().float(),
                                       linear.bias.bfloat16().float())
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert torch.allclose(got, rounded, atol=2e-2, rtol=1e-2)
    assert torch.allclose(got, exact, atol=5e-2, rtol=5e-2)
    assert "bf16" in packed.extra_repr()


def test_draft_tier_settings_refuse_a_negative_head():
    assert DraftConfig().draft_head_tokens > 0 and DraftConfig().linear_kernels == "bf16"
    assert DraftConfig(draft_head_tokens=0).draft_head_tokens == 0
    with pytest.raises(ValueError, match="draft_head_tokens"):
        DraftConfig(draft_head_tokens=-1)
