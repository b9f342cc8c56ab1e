"""The decode loop samples exactly from the target with a reduced-vocabulary draft.

A distilled draft proposes from a q supported on a subset of the target's
vocabulary (FR-Spec); target tokens outside it are never drafted and can only
come back as recovered or bonus tokens. Same method as
tests/test_distribution_models.py (real engines and servicers, a real Redis,
thousands of seeded sessions, a chi-square test against the exact two-token
distribution), with a distilled draft folder over 6 of the tiny target's 10 tokens.
"""
from __future__ import annotations

import pytest
import torch

import orchestrator.decode as decode
from distill.draft_model import build_draft
from specmesh.speculative import Acceptance
from specmesh.distilled import VocabMap, load_draft, save_draft
from specmesh.models import load_model
from tests.tiny_models import build_tiny_model
from tests.test_distribution_models import ALPHA, PARAMS, p_value

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

SUBSET = (1, 2, 3, 4, 6, 8)   # </s> and five letters; <unk>, 'd', 'f' and 'h' are never proposed


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("distilled-tiny")
    target = load_model(str(build_tiny_model(root / "target", seed=11, vocab="tiny", init_std=0.15)))
    model = build_draft(target.model, SUBSET, layers=1)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():          # a draft that disagrees with the target: rejections happen
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    info = target.info
    vocab_map = VocabMap(info.name, info.vocab_size, info.vocab_fingerprint, SUBSET, info.eos_token_ids,
                         info.max_context)
    save_draft(root / "draft", model, vocab_map, card="# test draft\n")
    return target, root / "draft"


def test_the_draft_really_is_reduced(pair):
    target, folder = pair
    draft = load_draft(str(folder), target=target.info)
    assert draft.model.get_output_embeddings().weight.shape[0] == len(SUBSET) + 1
    outside = set(range(target.info.vocab_size)) - set(SUBSET)
    assert outside and all(int(draft.target_to_draft[t]) == len(SUBSET) for t in outside)


@pytest.mark.parametrize("name", list(PARAMS))
def test_decode_loop_samples_the_target_distribution(pair, redis_url, name):
    target, draft = pair
    p = p_value(target, draft, redis_url, PARAMS[name])
    assert p > ALPHA, f"{name}: chi-square p = {p:.2e}"


def test_the_check_catches_a_wrong_rule(pair, redis_url, monkeypatch):
    """Accepting every draft token gives the draft's distribution, which never has 'd', 'f' or 'h'."""
    def accept_everything(draft_tokens, draft_probs, scores, seed, start_position):
        return Acceptance(len(draft_tokens), list(draft_tokens) + [scores.bonus_token], True)

    monkeypatch.setattr(decode, "accept", accept_everything)
    target, draft = pair
    p = p_value(target, draft, redis_url, PARAMS["temperature 1"], draws=1000)
    assert p < ALPHA, f"a wrong acceptance rule passed the check (p = {p:.3f})"
