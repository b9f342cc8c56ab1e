"""The keystone: at temperature 0, speculative output is the target's output, token for token.

Everything goes through three separate service processes over gRPC and Redis.
The reference is target-only greedy decoding computed independently in this
process with the plain Hugging Face model (no KV tricks, no services), and
k = 0 through the services must match it too.
"""
from __future__ import annotations

import pytest
import torch

from specmesh.client import Client
from specmesh.models import load_model

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

TINY_PROMPTS = ["hello world, hello world, hello", "the cat sat on the mat. the cat", "abc abc abc abc 123"]


def reference_greedy(model_spec: str, prompt_ids: list[int], n: int, eos: set[int]) -> list[int]:
    loaded = load_model(model_spec)
    ids = list(prompt_ids)
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = loaded.model(input_ids=torch.tensor([ids])).logits[0, -1]
            token = int(torch.argmax(logits))
            out.append(token)
            ids.append(token)
            if token in eos:
                break
    return out


@pytest.fixture(scope="module")
def tiny_reference(tiny_models, tiny_cluster):
    loaded = load_model(str(tiny_models["target"]))
    refs = {}
    for prompt in TINY_PROMPTS:
        prompt_ids = loaded.tokenizer(prompt).input_ids
        refs[prompt] = reference_greedy(str(tiny_models["target"]), prompt_ids, 40, set(loaded.info.eos_token_ids))
    return refs


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_tiny_speculative_equals_target_only(tiny_client, tiny_reference, drafter, k):
    for prompt in TINY_PROMPTS:
        baseline = tiny_client.generate(prompt, max_new_tokens=40, k=0)
        assert baseline.token_ids == tiny_reference[prompt], "k=0 through the services differs from plain HF greedy"
        spec = tiny_client.generate(prompt, max_new_tokens=40, k=k, drafter=drafter)
        assert spec.token_ids == tiny_reference[prompt]
        assert spec.text == baseline.text
        assert spec.stats.draft_tokens > 0 or drafter == "ngram"


def test_tiny_drafts_are_really_accepted_and_rejected(tiny_client):
    """The equality above is only meaningful if both branches of the rule ran."""
    totals = {"draft": 0, "accepted": 0, "steps": 0, "tokens": 0}
    for prompt in TINY_PROMPTS:
        for drafter in ("ngram", "model"):
            r = tiny_client.generate(prompt, max_new_tokens=40, k=3, drafter=drafter)
            totals["draft"] += r.stats.draft_tokens
            totals["accepted"] += r.stats.accepted_tokens
            totals["steps"] += r.stats.steps
            totals["tokens"] += r.stats.committed_tokens
    assert 0 < totals["accepted"] < totals["draft"], totals
    assert totals["steps"] < totals["tokens"], "speculation never committed more than one token per step"


REAL_PROMPTS = [
    "Summarize: The Eiffel Tower is a wrought-iron lattice tower in Paris. It was built from 1887 to 1889 as the "
    "centerpiece of the 1889 World's Fair. The tower is 330 metres tall and was the tallest man-made structure in "
    "the world until 1930. Summary:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


@pytest.mark.real_model
@pytest.mark.parametrize("prompt", REAL_PROMPTS, ids=["summary", "code"])
def test_default_model_speculative_equals_target_only(real_cluster, prompt):
    with Client(real_cluster.address) as client:
        baseline = client.generate(prompt, max_new_tokens=48, k=0)
        loaded = load_model()
        reference = reference_greedy("smollm2", loaded.tokenizer(prompt).input_ids, 48, set(loaded.info.eos_token_ids))
        assert baseline.token_ids == reference
        assert len(reference) == 48 or reference[-1] in loaded.info.eos_token_ids
        accepted = 0
        for k in (1, 3, 5):
            spec = client.generate(prompt, max_new_tokens=48, k=k, drafter="ngram")
            assert spec.token_ids == baseline.token_ids, f"k={k}"
            accepted += spec.stats.accepted_tokens
        assert accepted > 0
