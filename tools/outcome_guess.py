"""How often could a draft tier guess a step's outcome before the verify returns?

Overlapping the tiers (ARCHITECTURE.md, "Where speed comes from", 3) means the
draft prepares step i + 1 while the verifier checks step i. Step i + 1 starts
after step i's outcome: how many draft tokens were accepted and the target's
next token. This replays an EAGLE draft's chain over held-out answers of a
`specmesh distill` work folder (never Spec-Bench questions) and counts how
often the true outcome is among the N the draft itself finds likeliest (its
chances of the accepted chain prefix times its chance of the next token).

    PYTHONPATH=$PWD python tools/outcome_guess.py --k 3 --top 1,2,4,8,16
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from distill.evaluate import eagle_replay
from distill.generate import load_examples
from specmesh.distilled import cut_head
from specmesh.drafts import resolve_draft
from specmesh.eagle import load_eagle
from specmesh.models import cache_dir


def chain_probs(model, cache, logits: torch.Tensor, hidden: torch.Tensor, k: int) -> tuple[list[int], list]:
    """Greedy chain of k draft ids from the draft's output at the last committed token, and its
    next-token distribution at each of the k + 1 positions."""
    drafted, probs = [], []
    for i in range(k + 1):
        p = torch.softmax(logits[:-1].float(), -1)         # the 'other' bucket is never proposed
        probs.append(p)
        if i == k:
            break
        drafted.append(int(p.argmax()))
        out, feature = model(torch.tensor([[drafted[-1]]]), hidden[None, None], cache=cache)
        logits, hidden = out[0, -1], feature[0, -1]
    return drafted, probs


def likeliest_outcomes(drafted: list[int], probs: list, per_length: int) -> list[tuple[float, int, int]]:
    """(the draft's chance, accepted length j, next draft id), best first. For j < k the next token is
    not the chain's own (that one would have been accepted)."""
    outcomes, prefix = [], 1.0
    for j, p in enumerate(probs):
        p = p.clone()
        if j < len(drafted):
            p[drafted[j]] = 0
        values, ids = p.topk(per_length)
        outcomes += [(prefix * float(v), j, int(t)) for v, t in zip(values, ids) if v > 0]
        if j < len(drafted):
            prefix *= float(probs[j][drafted[j]])
    return sorted(outcomes, reverse=True)


@torch.inference_mode()
def measure(draft, examples: list[dict], k: int, tops: list[int]) -> tuple[int, dict[int, int], list[int]]:
    """Replay the chain over every example (distill.evaluate's EAGLE replay); -> (steps whose answer went
    on past the accepted drafts, hits per number of outcomes prepared, steps per accepted length)."""
    model, t2d, d2t = draft.model, draft.target_to_draft, draft.draft_to_target
    hits, accepted_lengths = {n: 0 for n in tops}, [0] * (k + 1)
    ranked: list = []

    def chain(logits, hidden, cache, position):
        drafted, probs = chain_probs(model, cache, logits, hidden, k)
        ranked[:] = likeliest_outcomes(drafted, probs, max(tops))
        return d2t[torch.tensor(drafted, dtype=torch.long)].tolist(), list(range(-1, k - 1))

    def observe(accepted: int, target_next: int) -> None:
        accepted_lengths[accepted] += 1
        for n in tops:
            hits[n] += any(j == accepted and int(d2t[t]) == target_next for _, j, t in ranked[:n])

    for example in examples:
        eagle_replay(model, t2d, example, chain, observe)
    return sum(accepted_lengths), hits, accepted_lengths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default="smollm2-eagle", help="an EAGLE draft folder or shipped name")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="a `specmesh distill` work folder (default: the first under the specmesh cache)")
    p.add_argument("--head-tokens", type=int, default=2048, help="as the draft tier's draft_head_tokens")
    p.add_argument("--k", type=int, default=3, help="draft chain length")
    p.add_argument("--top", default="1,2,4,8,16", help="numbers of outcomes prepared")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    work = args.work_dir or next((cache_dir() / "distill").glob("*/data/heldout")).parent.parent
    examples = load_examples(sorted((work / "data" / "heldout").glob("shard-*.pt")))
    draft = load_eagle(resolve_draft(args.draft))
    cut_head(draft.model.lm, args.head_tokens)
    tops = [int(n) for n in args.top.split(",")]
    steps, hits, lengths = measure(draft, examples, args.k, tops)
    print(f"{len(examples)} held-out answers of {work.name}, chain k = {args.k}: {steps} steps; accepted length "
          f"0..{args.k}: " + ", ".join(f"{n / steps:.3f}" for n in lengths))
    for n in tops:
        print(f"  the step's outcome among the draft's {n:3d} likeliest: {hits[n] / steps:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
