"""The draft's vocabulary: the target's most frequent output tokens (FR-Spec).

A draft head over a few thousand tokens costs a fraction of the full one, and
the target's own generations are dominated by them: the coverage (share of
generated tokens inside the subset) is reported in the model card.
"""
from __future__ import annotations

from collections import Counter
from typing import Sequence


def choose_vocab(examples: Sequence[dict], size: int, always: Sequence[int]) -> tuple[list[int], float]:
    """Up to `size - 1` of the most frequent response tokens (plus `always`, e.g. EOS) -> (target ids, coverage).

    Only tokens seen in the data (answers, then prompts) are candidates, so a small data set gives a
    smaller vocabulary than asked for. Ties are broken by prompt frequency, then by id (deterministic).
    """
    outputs, inputs = Counter(), Counter()
    for e in examples:
        outputs.update(e["response_ids"])
        inputs.update(e["prompt_ids"])
    n_out = size - 1                      # one draft id is the input-only "other" bucket
    must = list(dict.fromkeys(always))[:n_out]
    ranked = sorted(set(outputs) | set(inputs), key=lambda t: (-outputs[t], -inputs[t], t))
    chosen = must + [t for t in ranked if t not in set(must)][:n_out - len(must)]
    total = sum(outputs.values())
    coverage = sum(outputs[t] for t in chosen) / total if total else 0.0
    return chosen, coverage
