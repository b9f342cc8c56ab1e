"""Prompts the target writes itself, for the kinds of request the templates miss.

The templates of ``distill.prompts`` open each category in a handful of ways,
and more answers to them stopped moving the draft on requests written by
people (docs/distill.md, "twice the data"). An instruction-tuned target has
learned what users ask: given its chat template up to the user's turn, and the
first word or two of a request, it writes the rest of the request itself
(the Magpie recipe, Xu et al. 2024). The openings only steer the category;
everything after them is the target's own sample, so the requests are as
varied as the data the target was tuned on.

Written requests are noisy (a 135M target invents places and facts). That does
not matter here: the draft learns what the target answers to them, and the
target answers noise the way it answers anything else. Requests that do not
end within the budget, repeat one another, or share eight words running with a
Spec-Bench question turn (when the benchmark file is present) are dropped.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Sequence

import torch

from distill.generate import GenerationPlan, generate_batch
from distill.prompts import CATEGORIES, Prompt

# The first words of a request, per category: steering only, chosen from how people phrase such
# requests in general (never read off the benchmark). "" lets the target choose the whole request.
OPENINGS: dict[str, tuple[str, ...]] = {
    "writing": ("Write", "Compose", "Draft", "Can you write", "Create", "Help me write", "I need"),
    "roleplay": ("You are", "Pretend you are", "Imagine you are", "Act as", "Let's play a game.", "Roleplay as"),
    "reasoning": ("If", "Suppose", "Solve this puzzle:", "Which", "Is it true that", "Explain why"),
    "math": ("Solve", "Calculate", "What is", "Find", "Prove that", "Simplify"),
    "coding": ("Write a Python", "How do I", "Implement", "Explain this code:", "Fix the bug", "Write a function"),
    "extraction": ("Extract", "From the following text,", "Identify", "List all", "Parse", "Given the text below,"),
    "stem": ("Explain", "How does", "What is the difference between", "Describe", "Why do", "What causes"),
    "humanities": ("Discuss", "What was", "Analyze", "Compare", "Why did", "What is the significance of"),
    "translation": ("Translate", "Translate the following", "How do you say", "Translate this"),
    "summarization": ("Summarize", "Summarize the following", "Write a summary of", "Give me a brief summary",
                      "TL;DR:"),
    "qa": ("What", "Who", "When", "Where", "How many", "Why", ""),
    "math_reasoning": ("A", "If a", "There are", "Tom", "Sarah", "A store", "Each"),
    "rag": ("Read the following", "Based on the passage", "Given the context", "Context:", "According to",
            "Use the text"),
}

# Requests that carry a text (an article to summarize, a passage to answer from) need room for it.
LONG = frozenset({"summarization", "rag", "extraction", "translation"})
WRITE_TEMPERATURE = 0.9      # Magpie samples at 1.0; a 135M target wanders off more there
MAX_TOKENS = {True: 256, False: 96}
MIN_WORDS = 3


def user_turn_prefix(tokenizer) -> str:
    """The chat template's text before a user message's content (system turn included)."""
    if tokenizer.chat_template is None:
        raise ValueError("the target has no chat template, so it cannot be asked to write a user's request")
    marker = "\u2063SPECMESH\u2063"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=False,
                                             tokenize=False)
    return rendered[:rendered.index(marker)]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class BenchFilter:
    """Drops a request that is, contains, or shares eight words running with a benchmark turn."""

    def __init__(self, questions: Path | None):
        turns = []
        if questions is not None and questions.exists():
            turns = [t for line in questions.read_text().splitlines() if line.strip()
                     for t in json.loads(line)["turns"]]
        self.turns = [" ".join(_words(t)) for t in turns]
        self.grams = {g for t in turns for g in _grams(_words(t))}

    def __call__(self, text: str) -> bool:
        """True when `text` may be trained on."""
        words = _words(text)
        if _grams(words) & self.grams:
            return False
        mine = " ".join(words)
        return not any(mine and (mine == t or mine in t or t in mine) for t in self.turns if t)


def _grams(words: list[str], n: int = 8) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def write_prompts(model, tokenizer, eos_ids: Sequence[int], n_per_category: int, seed: int, batch_size: int,
                  path: Path, keep: Callable[[str], bool], progress: Callable[[int], None] = lambda n: None,
                  planned: Callable[[int], None] = lambda n: None, rounds: int = 4,
                  drop_finished_rows: bool = True, sampler: str = "inverse-cdf") -> list[Prompt]:
    """n_per_category requests per category written by the target, kept in `path` (JSON) so that a resumed
    run reads them back instead of sampling again. Each round samples what is still missing, plus a
    margin for the requests the filters drop; a category that is still short after `rounds` keeps what it has.
    `planned(n)`: a round will sample n requests; `progress(n)`: n more were sampled."""
    if path.exists():
        return [Prompt(**p) for p in json.loads(path.read_text())]
    prefix = user_turn_prefix(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    kept: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    seen: set[str] = set()
    batch_number = 0
    for round_ in range(rounds):
        wanted = {c: n_per_category - len(kept[c]) for c in CATEGORIES}
        rows = []
        for category in CATEGORIES:
            openings = OPENINGS[category]
            # A quarter more than missing: ends past the budget, repeats and empty requests are dropped.
            for i in range((wanted[category] * 5 + 3) // 4):
                opening = openings[(i + round_) % len(openings)]
                rows.append(dict(index=len(rows), category=category, opening=opening, temperature=WRITE_TEMPERATURE,
                                 prompt_ids=tokenizer.encode(prefix + opening, add_special_tokens=False)))
        if not rows:
            break
        planned(len(rows))
        # Long and short requests in separate batches: a batch decodes as long as its longest row.
        rows.sort(key=lambda r: (r["category"] in LONG, r["index"]))
        for start in range(0, len(rows), batch_size):
            batch = rows[start:start + batch_size]
            long = any(r["category"] in LONG for r in batch)
            plan = GenerationPlan(max_new_tokens=MAX_TOKENS[long], batch_size=batch_size, top_k_stored=1,
                                  temperature=WRITE_TEMPERATURE, drop_finished_rows=drop_finished_rows,
                                  sampler=sampler)
            generator = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + batch_number)
            batch_number += 1
            for row in generate_batch(model, batch, plan, eos_ids, pad_id, generator):
                response = row["response_ids"]
                if not response or response[-1] not in eos_ids:
                    continue                     # ran past the budget: an unfinished request
                text = (row["opening"] + tokenizer.decode(response[:-1], skip_special_tokens=True)).strip()
                category = row["category"]
                if (len(text.split()) < MIN_WORDS or text in seen or len(kept[category]) >= n_per_category
                        or not keep(text)):
                    continue
                seen.add(text)
                kept[category].append(text)
            progress(len(batch))
    prompts = [Prompt(c, text) for c in CATEGORIES for text in kept[c]]
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([dict(category=p.category, text=p.text) for p in prompts], indent=0))
    tmp.replace(path)
    return prompts
