"""The shipped drafts of the default target (specmesh/drafts/smollm2-135m-draft, and the
EAGLE-style specmesh/drafts/smollm2-135m-eagle).

Greedy equality through the three services: speculative output with the
distilled draft is the target's own greedy output, token for token, and the
draft really proposes (some draft tokens are accepted).
"""
from __future__ import annotations

import pytest

from specmesh.client import Client
from specmesh.drafts import SHIPPED, default_draft, default_eagle, draft_for, eagle_for, resolve_draft
from specmesh.distilled import load_draft
from specmesh_cli.launcher import Cluster
from specmesh.models import load_tokenizer
from specmesh_cli.ports import free_port
from tests.test_greedy_equality import REAL_PROMPTS

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

FOLDER = SHIPPED["smollm2-draft"]
EAGLE = SHIPPED["smollm2-eagle"]
CHAT_PROMPTS = ["Explain why the sky is blue in three sentences.", "Write a Python function that adds two numbers."]


@pytest.mark.parametrize("folder", [FOLDER, EAGLE], ids=["lm", "eagle"])
def test_the_shipped_draft_is_small_and_documented(folder):
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    assert size <= 20 * 2**20, f"{size / 2**20:.1f} MiB"
    card = (folder / "README.md").read_text()
    assert "specmesh distill" in card and "--seed" in card and "| overall |" in card


def test_default_target_gets_the_shipped_draft():
    assert default_draft(None) == "smollm2-draft" and default_draft("smollm2") == "smollm2-draft"
    assert default_draft("/some/other/model") is None
    assert draft_for(None, "none") is None and draft_for(None, "/my/draft") == "/my/draft"
    assert resolve_draft("smollm2-draft") == str(FOLDER)
    assert default_eagle(None) == "smollm2-eagle" and default_eagle("/some/other/model") is None
    assert eagle_for(None, "none") is None and eagle_for(None, None) == "smollm2-eagle"
    assert resolve_draft("smollm2-eagle") == str(EAGLE)


@pytest.mark.real_model
def test_the_shipped_draft_fits_the_default_target():
    _, info = load_tokenizer("smollm2")
    draft = load_draft(resolve_draft("smollm2-draft"), target=info)
    assert draft.info.vocab_fingerprint == info.vocab_fingerprint
    from specmesh.eagle import load_eagle

    eagle = load_eagle(resolve_draft("smollm2-eagle"), target=info)
    assert eagle.model.hidden_size == 576


@pytest.fixture(scope="module")
def distilled_cluster(tmp_path_factory, redis_url):
    """The default target with the shipped draft, as `specmesh up` serves it with no flags."""
    with Cluster(draft_model=draft_for(None, None), eagle_model=eagle_for(None, None), port=free_port(),
                 redis_url=redis_url,
                 log_dir=tmp_path_factory.mktemp("logs-distilled"), startup_timeout_s=900) as cluster:
        yield cluster


@pytest.mark.real_model
@pytest.mark.parametrize("drafter, ks", [("model", (1, 4)), ("eagle", (4,))])
def test_greedy_equality_with_the_shipped_drafts(distilled_cluster, drafter, ks):
    """Speculative output with either shipped draft (the EAGLE one reads the target's features) is the
    target's own greedy output, and the draft really proposes."""
    accepted = 0
    with Client(distilled_cluster.address) as client:
        for prompt, chat in [(p, False) for p in REAL_PROMPTS] + [(p, True) for p in CHAT_PROMPTS]:
            baseline = client.generate(prompt, chat=chat, max_new_tokens=48, k=0)
            for k in ks:
                spec = client.generate(prompt, chat=chat, max_new_tokens=48, k=k, drafter=drafter)
                assert spec.token_ids == baseline.token_ids, f"k={k}: {prompt[:40]!r}"
                assert spec.drafter == drafter
                accepted += spec.stats.accepted_tokens
    assert accepted > 0


def test_requests_naming_no_drafter_get_the_measured_choice(tmp_path):
    from specmesh.drafts import default_drafter
    from specmesh.eagle import EAGLE_FILE

    everything = {"ngram", "model", "hybrid", "eagle", "eagle-hybrid"}
    assert default_drafter(("smollm2-eagle", "smollm2-draft"), everything) == "eagle-hybrid"
    assert default_drafter(("SMOLLM2-EAGLE", None), {"ngram", "eagle", "eagle-hybrid"}) == "eagle-hybrid"
    # the shipped plain draft alone: n-gram measured faster than it
    assert default_drafter((None, "smollm2-draft"), {"ngram", "model", "hybrid"}) == "ngram"
    assert default_drafter(("none", "smollm2-draft"), {"ngram", "model", "hybrid"}) == "ngram"
    assert default_drafter((None, "/my/own/draft"), {"ngram", "model", "hybrid"}) == "model"
    assert default_drafter((None, None), {"ngram"}) == "ngram"
    # An EAGLE draft of the user's own (say, the shipped one fitted with --init-from) is served by the same
    # drafters as the shipped one: it gets the same choice, even beside the shipped plain draft.
    (tmp_path / EAGLE_FILE).write_bytes(b"")
    assert default_drafter((str(tmp_path), "smollm2-draft"), everything) == "eagle-hybrid"
    assert default_drafter((str(tmp_path), None), {"ngram", "eagle", "eagle-hybrid"}) == "eagle-hybrid"
