"""Batch-invariant numerics (specmesh/invariant.py): a position's logits are the same bits
however the position was computed: in one prefill, in chunks, step by step with feeds of any
size, or batched beside other sessions of other lengths. That is what keeps a sampled output
identical when a verifier rebuilds a cache after a crash, or batches differently under load."""
from __future__ import annotations

import pytest
import torch

from specmesh import kv
from specmesh.fast_linear import FusedPart, PackedLinear, apply_kernels
from specmesh.invariant import ATTENTION, make_batch_invariant
from specmesh.kv import KVSession
from verifier_service.batching import batched_forward


def _llama(kv_heads: int, heads: int = 4, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


# Grouped-query attention (2 query heads per key head) and plain multi-head (1), where a
# one-token step gives the attention's products a single row: the path that needs doubling.
@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def models(request):
    """(stock SDPA model, the same weights made batch-invariant)."""
    stock = _llama(kv_heads=request.param)
    invariant = _llama(kv_heads=request.param)
    invariant.load_state_dict(stock.state_dict())
    assert make_batch_invariant(invariant)
    return stock, invariant


TOKENS = torch.randint(1, 97, (300,), generator=torch.Generator().manual_seed(1)).tolist()
P = 260   # compare the logits that predict positions P .. P + 4


def _prefill(model, chunk=None, monkeypatch=None):
    if chunk:
        monkeypatch.setattr(kv, "PREFILL_CHUNK", chunk)
    session = KVSession("a", model)
    session.sync(0, TOKENS[:P])
    return session.forward(TOKENS[P:P + 4])


def _steps(model, sizes=(1, 3, 2, 5, 9, 4)):
    """Decode like a verifier does: feed k + 1 tokens, keep some, roll the rest back."""
    session = KVSession("a", model)
    session.sync(0, TOKENS[:40])
    session.forward(last_only=True)
    n, i = 40, 0
    while n < P:
        size = sizes[i % len(sizes)]
        i += 1
        session.forward(TOKENS[n:n + size])     # k = size draft tokens scored
        kept = min(1 + i % 3, P - n)            # some accepted, the rest rejected
        session.sync(n, TOKENS[n:n + kept])
        n += kept
    session.sync(P, [])
    return session.forward(TOKENS[P:P + 4])


def _tree_steps(model):
    """Decode like a verifier does with draft trees: the accepted path is on the first chain on some
    steps, off it on others (a second child of the root, then its child), and none on others."""
    session = KVSession("a", model)
    session.sync(0, TOKENS[:40])
    session.forward(last_only=True)
    n, i = 40, 0
    while n < P - 3:
        i += 1
        a, b = TOKENS[n], TOKENS[n + 1]
        x, y = (a + 1) % 97 or 1, (b + 2) % 97 or 1                  # never the text's tokens
        nodes, parents, path = [[x, y, a, b, y], [-1, 0, -1, 2, 2], [2, 3]] if i % 3 == 0 else \
            [[a, b, x, y], [-1, 0, 1, -1], [0, 1]] if i % 3 == 1 else [[x, y, y], [-1, 0, -1], []]
        session.forward(nodes, parents=parents)
        on_chain = next((j for j, node in enumerate(path) if node != j), len(path))
        accepted = len(path)
        session.sync(n + on_chain, TOKENS[n + on_chain:n + accepted + 1])   # the path, then the end token
        n += accepted + 1
    session.sync(n, TOKENS[n:P])
    return session.forward(TOKENS[P:P + 4])


def _neighbours(model) -> list[KVSession]:
    """Two sessions whose caches are longer and shorter than session a's (left padding differs)."""
    sessions = []
    for name, prompt in [("long", TOKENS[::-1][:290]), ("short", TOKENS[5:30])]:
        s = KVSession(name, model)
        s.sync(0, prompt)
        s.forward(last_only=True)
        sessions.append(s)
    return sessions


def _batched(model):
    """Session a beside two others whose caches are longer and shorter (left padding differs)."""
    session = KVSession("a", model)
    session.sync(0, TOKENS[:P - 6])
    session.forward(last_only=True)
    session.sync(P - 6, TOKENS[P - 6:P])
    long, short = _neighbours(model)
    rows = batched_forward(model, [long, session, short], [[3, 4], TOKENS[P:P + 4], [5, 6, 7, 8, 9, 10, 11]])
    return rows[1]


def test_a_position_gets_the_same_bits_however_it_is_computed(models, monkeypatch):
    _, model = models
    reference = _prefill(model)
    assert reference.shape == (5, 97)
    assert torch.equal(_steps(model), reference)
    assert torch.equal(_steps(model, sizes=(2, 7)), reference)
    assert torch.equal(_batched(model), reference)
    assert torch.equal(_tree_steps(model), reference)      # a tree's first chain and re-fed path: chain bits
    assert torch.equal(_prefill(model, chunk=16, monkeypatch=monkeypatch), reference)


def test_fused_sibling_products_give_the_unfused_bits(models):
    """q/k/v and gate/up share one oneDNN product each (fast_linear.fuse_siblings): every path's logits
    are the bits of the same model with a product per layer."""
    stock, fused = models
    parts = [m for m in fused.modules() if isinstance(m, FusedPart)]
    assert len(parts) == 5 * 2      # q, k, v, gate, up in each of the 2 layers
    unfused = _llama(kv_heads=stock.config.num_key_value_heads)
    unfused.load_state_dict(stock.state_dict())
    assert make_batch_invariant(unfused, fuse=False)
    assert not any(isinstance(m, FusedPart) for m in unfused.modules())
    for compute in (_prefill, _steps, _batched, _tree_steps):
        assert torch.equal(compute(fused), compute(unfused))


def test_sibling_products_stay_apart_where_fusing_would_change_bits(monkeypatch, caplog):
    """The load probe compares the fused logits with the separate products': on a build where they
    differ (simulated: one ulp added to the fused product), the layers keep a product each."""
    from specmesh import fast_linear

    real = fast_linear._SiblingProduct.part
    monkeypatch.setattr(fast_linear._SiblingProduct, "part",
                        lambda self, x, index: torch.nextafter(real(self, x, index), torch.tensor(float("inf"))))
    model = _llama(kv_heads=2)
    assert make_batch_invariant(model)
    assert not any(isinstance(m, FusedPart) for m in model.modules())
    layer = model.model.layers[0]
    assert all(type(m) is PackedLinear for m in (layer.self_attn.q_proj, layer.mlp.up_proj))
    assert "left unfused" in caplog.text


def _features(model):
    """The last hidden states a Verify returns for EAGLE drafts: one session alone, then batched."""
    session = KVSession("a", model)
    session.sync(0, TOKENS[:P])
    session.forward(TOKENS[P:P + 4], features=True)
    alone = session.fed_features[1]
    long, short = _neighbours(model)
    batched_forward(model, [long, session, short], [[3, 4], TOKENS[P + 5:P + 7], [5]], [True, True, False])
    return torch.cat([alone, session.fed_features[1], long.fed_features[1]])


def test_the_lean_forward_gives_transformers_bits(models):
    """The target's forward without transformers' per-layer plumbing (lean_decoder.use_lean_forward):
    logits and returned features are transformers' bits on every path a verifier takes."""
    from specmesh.lean_decoder import LEAN, use_lean_forward

    _, model = models
    paths = (_prefill, _steps, _batched, _tree_steps, _features)
    assert getattr(model, LEAN, None) is None
    want = [compute(model) for compute in paths]
    assert use_lean_forward(model)
    try:
        got = [compute(model) for compute in paths]
    finally:
        setattr(model, LEAN, None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_model_the_lean_forward_does_not_fit_keeps_transformers(monkeypatch, caplog):
    """A probe that sees other bits (simulated: one ulp added to the lean decoder's output) leaves the model
    on transformers' forward, with a warning; so does a model on another attention."""
    from specmesh import lean_decoder

    stock = _llama(kv_heads=2)
    assert not lean_decoder.use_lean_forward(stock)                     # SDPA: not the lean decoder's attention
    real = lean_decoder.LeanDecoder.__call__
    monkeypatch.setattr(lean_decoder.LeanDecoder, "__call__",
                        lambda self, *a, **k: torch.nextafter(real(self, *a, **k), torch.tensor(float("inf"))))
    model = _llama(kv_heads=2)
    apply_kernels(model, "packed", batch_invariant=True)
    assert model.config._attn_implementation == ATTENTION
    assert getattr(model, lean_decoder.LEAN) is None
    assert "keeps transformers' forward" in caplog.text


def test_a_tree_node_gets_the_bits_of_its_path_fed_as_a_chain(models):
    """A draft tree puts masked keys (other branches) between a node's ancestors, not only after them:
    its rows still carry the chain's bits, so a tree verify keeps sampled outputs reproducible."""
    _, model = models
    n = 200
    distractors = [(t + 5) % 97 or 1 for t in TOKENS[n:n + 7]]
    nodes = distractors[:6] + [TOKENS[n], TOKENS[n + 1], distractors[6]]
    parents = [-1, 0, 1, -1, 3, 4, -1, 6, 6]              # two branches first; the text's path is nodes 6, 7
    tree = KVSession("tree", model)
    tree.sync(0, TOKENS[:n])
    tree.forward(last_only=True)
    rows = tree.forward(nodes, parents=parents)
    chain = KVSession("chain", model)
    chain.sync(0, TOKENS[:n])
    chain.forward(last_only=True)
    expected = chain.forward(TOKENS[n:n + 2])
    assert torch.equal(rows[0], expected[0]) and torch.equal(rows[7], expected[1]) and torch.equal(rows[8], expected[2])


def test_batch_invariant_logits_are_the_models_own(models, monkeypatch):
    """The same function as stock attention, to float rounding, on every path (padding included)."""
    stock, model = models
    for compute in (_prefill, _steps, _batched):
        torch.testing.assert_close(compute(model), compute(stock), atol=2e-4, rtol=1e-4)


def test_every_linear_layer_and_the_attention_switch(models):
    _, model = models
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed and all(m.invariant for m in packed)
    assert model.config._attn_implementation == ATTENTION


def test_apply_kernels_turns_it_on_only_with_packed_fp32_cpu_weights():
    model = _llama(kv_heads=2)
    apply_kernels(model, "stock", batch_invariant=True)       # cannot provide it: left as it was
    assert model.config._attn_implementation != ATTENTION
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    half = _llama(kv_heads=2).to(torch.bfloat16)
    assert make_batch_invariant(half) is False
    assert half.config._attn_implementation != ATTENTION
    apply_kernels(model, "packed", batch_invariant=True)
    assert model.config._attn_implementation == ATTENTION
    assert model.specmesh_lean is not None          # and the forward runs on specmesh.lean_decoder


def test_a_rebuilt_verifier_cache_scores_sampled_drafts_identically(tiny_models):
    """The verifier after a crash: the session's cache rebuilt in one prefill from Redis's tokens,
    against the one built step by step. Sampled scores (recovered and bonus tokens) are identical."""
    from specmesh.config import VerifierConfig
    from specmesh.models import load_model
    from specmesh.proposal import DraftProposal
    from specmesh.sampling import SamplingParams
    from verifier_service.engine import TargetEngine, VerifyCall

    loaded = load_model(str(tiny_models["target"]))
    apply_kernels(loaded.model, "packed", batch_invariant=True)
    engine = TargetEngine(loaded, VerifierConfig())
    params = SamplingParams(temperature=0.8)
    vocab = loaded.info.vocab_size
    committed = [t % vocab for t in TOKENS[:120]]
    drafts = [DraftProposal.point_mass(t % vocab) for t in (7, 9, 11)]
    engine.prefill("live", committed[:20])
    for n in range(20, 120, 4):
        engine.verify_batch([VerifyCall("live", n, committed[n:n + 4], drafts, params, seed=5)])
    live = engine.verify_batch([VerifyCall("live", 120, [], drafts, params, seed=5)])[0]
    rebuilt = engine.verify_batch([VerifyCall("rebuilt", 0, committed, drafts, params, seed=5)])[0]
    assert live.cached_len == rebuilt.cached_len
    assert live.scores == rebuilt.scores


def test_a_model_whose_attention_it_does_not_implement_keeps_its_own():
    """Gemma 2 soft-caps its attention scores: the check at load sees the difference and backs off."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_logit_softcapping=5.0,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    assert make_batch_invariant(model) is False
    assert model.config._attn_implementation == "eager"
    assert not any(isinstance(m, PackedLinear) and m.invariant for m in model.modules())


def test_a_sliding_window_stays_the_models_own():
    """Attention with a window: the mask's pattern is followed, whatever it is."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    stock = MistralForCausalLM(config).eval()
    model = MistralForCausalLM(config).eval()
    model.load_state_dict(stock.state_dict())
    assert make_batch_invariant(model)
    ids = torch.tensor([TOKENS[:40], TOKENS[40:80]])
    mask = torch.ones_like(ids)
    mask[1, :7] = 0                                    # the second row left-padded, as a batch is
    with torch.inference_mode():
        got = model(input_ids=ids, attention_mask=mask).logits
        expected = stock(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[0], expected[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(got[1, 7:], expected[1, 7:], atol=2e-4, rtol=1e-4)


def test_a_one_token_prompt_gets_the_same_bits_as_inside_a_longer_one(models):
    """A one-token prompt: one query against one key (oneDNN takes other kernels for a single row)."""
    _, model = models
    alone = KVSession("one", model)
    alone.sync(0, TOKENS[:1])
    alone.forward(last_only=True)                      # position 0 computed alone: one query, one key
    alone.sync(1, TOKENS[1:2])
    after_one = alone.forward(TOKENS[2:4])             # position 0's cache entries reused
    together = KVSession("many", model)
    together.sync(0, TOKENS[:2])
    assert torch.equal(after_one, together.forward(TOKENS[2:4]))


def test_onednn_caches_are_bounded_unless_the_operator_set_them(monkeypatch):
    """Attention meets a new shape nearly every step: at oneDNN's default of 1,024 cached entries
    (~100 KB each), a verifier's memory grew ~400 MB under load and stayed."""
    from specmesh import invariant

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "32")
    assert make_batch_invariant(_llama(kv_heads=2))
    import os

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(invariant.ONEDNN_CACHE_ENTRIES)
    assert os.environ["LRU_CACHE_CAPACITY"] == "32"


def test_bf16_draft_kernels_stay_batch_invariant_and_close_to_fp32(monkeypatch):
    """linear_kernels=bf16 (the draft tier's default): every linear layer reads bf16-packed weights,
    a position still gets the same bits however it was computed, and the logits stay near fp32's."""
    from specmesh.fast_linear import bf16_available

    if not bf16_available():
        pytest.skip("this CPU's oneDNN has no bfloat16 products")   # then apply_kernels leaves fp32
    fp32 = _llama(kv_heads=2)
    bf16 = _llama(kv_heads=2)
    bf16.load_state_dict(fp32.state_dict())
    apply_kernels(fp32, "packed", batch_invariant=True)
    apply_kernels(bf16, "bf16", batch_invariant=True)
    layers = [m for m in bf16.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.bf16 and m.packed.dtype == torch.bfloat16 for m in layers)
    assert bf16.config._attn_implementation == ATTENTION
    one = _prefill(bf16)
    assert torch.equal(_prefill(bf16, chunk=64, monkeypatch=monkeypatch), one)
    assert torch.equal(_steps(bf16), one)
    reference = _prefill(fp32)
    assert (one - reference).abs().max() < 0.05 * reference.abs().max()
    assert torch.equal(one.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("rows", [3, 4, 8])
def test_thin_products_padded_to_more_rows_give_the_same_bits(models, monkeypatch, rows):
    """fast_linear.set_min_rows pads thinner products with copies of their last row (a CPU may run
    the padded product faster): every path's logits keep the bits of the doubled lone row."""
    from specmesh.fast_linear import products, set_min_rows

    _, model = models
    assert products(model) and all(p.min_rows == 2 for p in products(model))
    expected = [compute(model) for compute in (_prefill, _steps, _batched, _tree_steps)]
    set_min_rows(model, rows)
    try:
        assert all(p.min_rows == rows for p in products(model))
        got = [compute(model) for compute in (_prefill, _steps, _batched, _tree_steps)]
    finally:
        set_min_rows(model, 2)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_fastest_padding_measured_is_the_one_kept(monkeypatch, caplog):
    """choose_min_rows keeps the candidate whose products ran fastest: here a clock on which each
    candidate costs what the table says (6 rows the cheapest)."""
    from specmesh import fast_linear

    model = _llama(kv_heads=2)
    assert make_batch_invariant(model)
    found = fast_linear.products(model)
    cost = {2: 3.0, 3: 2.0, 4: 1.0, 6: 0.5, 8: 4.0}
    now = [0.0]

    def clock() -> float:          # each reading advances by what the rows set now cost
        now[0] += cost[found[0].min_rows]
        return now[0]

    monkeypatch.setattr(fast_linear.time, "perf_counter", clock)
    with caplog.at_level("INFO", logger="specmesh.fast_linear"):
        assert fast_linear.choose_min_rows(model) == 6
    assert all(p.min_rows == 6 for p in found)
    assert "padded to 6 rows" in caplog.text


def test_apply_kernels_measures_the_padding_unless_it_is_given(monkeypatch):
    from specmesh import fast_linear
    from specmesh.config import DraftConfig, VerifierConfig

    chosen = []
    monkeypatch.setattr(fast_linear, "choose_min_rows", lambda model: chosen.append(model) or 2)
    measured, given = _llama(kv_heads=2), _llama(kv_heads=2)
    apply_kernels(measured, "packed", batch_invariant=True)
    apply_kernels(given, "packed", batch_invariant=True, min_rows=5)
    assert chosen == [measured]
    assert {p.min_rows for p in fast_linear.products(given)} == {5}
    for config in (DraftConfig, VerifierConfig):
        assert config().min_product_rows == 0
        with pytest.raises(ValueError, match="min_product_rows"):
            config(min_product_rows=-1)
