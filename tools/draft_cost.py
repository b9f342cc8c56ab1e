"""What one draft step costs, and what it accepts, as the draft tier serves it.

    PYTHONPATH=$PWD python tools/draft_cost.py [--draft smollm2-eagle] \
        [--variants packed:0,bf16:0,packed:2048,bf16:2048,bf16:2048:2:3] [--heldout WORK_FOLDER]

A variant is LINEAR_KERNELS:DRAFT_HEAD_TOKENS[:TREE_BRANCH[:TREE_DEPTH[:TREE_MIN_CONFIDENCE]]],
the draft tier's settings (`--linear-kernels`, `--draft-head-tokens`,
`--tree-branch`, `--tree-depth`, `--tree-min-confidence`, each defaulting as the tier does;
batch-invariant numerics stay on, as served). Each is loaded through the
drafter's own from_config, so this is the code the service runs: an EAGLE
draft proposes a tree unless its branch is 1.

Cost: one Propose of k tokens after a ~300-token context, the way a session
steps: sync two committed tokens (with features, for an EAGLE draft), then
propose. Variants take turns round by round; the median is printed. With
--grow N the context grows N tokens a round, as a session's does, instead of
rolling back to the same length, and with --unpadded each variant also runs on
transformers' own KV cache: what the padded one (specmesh/padded_cache.py)
saves shows only with a growing context.

Acceptance (with --heldout, a `specmesh distill` work folder): the greedy
committed tokens per step at k over its held-out answers, replayed as the
model card's figure is (distill/evaluate.py), with the variant's chain or
tree and its served numerics, never Spec-Bench. For a tree, also the nodes
verified and the draft passes run per step (the first pass reads the
committed tokens, one more per layer grown): with a confidence cut both vary
by step, and the cost above, of a context of made-up tokens, does not show it.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import statistics
import time

import torch

from specmesh.config import DraftConfig
from specmesh.distilled import is_distilled_draft
from specmesh.drafts import resolve_draft
from specmesh.eagle import is_eagle_draft
from specmesh.sampling import SamplingParams


def load(draft: str, variant: str):
    """The drafter for a variant (kernels:head[:branch[:depth]]), through the tier's own loader."""
    from draft_service.drafters import eagle, model

    eagle._load.cache_clear()       # every variant gets its own copy: packing changes a model in place
    model._load.cache_clear()
    kernels, head, *tree = variant.split(":")
    settings = dict(linear_kernels=kernels, draft_head_tokens=int(head or 0))
    settings.update({name: kind(value) for (name, kind), value
                     in zip((("tree_branch", int), ("tree_depth", int), ("tree_min_confidence", float)), tree)})
    if is_eagle_draft(resolve_draft(draft)):
        return eagle.EagleDrafter.from_config(DraftConfig(eagle_model=draft, **settings))
    return model.ModelDrafter.from_config(DraftConfig(draft_model=draft, **settings))


def step(drafter, state, k: int, context: int, grow: int = 0) -> float:
    """Sync two new committed tokens (a step's accepted + bonus), propose k; -> seconds of the propose.
    Every step rolls back to the context, whatever the drafter left in its state (a chain's drafts
    or none, for a tree), grown by `grow` tokens since the last, so every variant drafts at the same
    length in a round."""
    start = context - 2 - grow
    tail = [11 + i % 50 for i in range(2 + grow)]
    if getattr(drafter, "uses_target_features", False):
        state.sync(start, tail, None, torch.randn(len(tail), drafter.feature_dim))
    else:
        state.sync(start, tail)
    began = time.perf_counter()
    drafter.propose(state, k, SamplingParams(), 0, 8)
    return time.perf_counter() - began


def tree_shape(drafter, k: int) -> tuple[int, int] | None:
    """(depth, branch) of the tree the drafter proposes at k (EagleDrafter.tree_shape), None for a chain."""
    return drafter.tree_shape(k) if hasattr(drafter, "tree_shape") else None


def acceptance(drafter, work: str, k: int) -> str:
    """Held-out greedy committed tokens per step, and for a tree its nodes and draft passes per step."""
    from distill.evaluate import eagle_greedy_steps, eagle_tree_greedy_steps, greedy_steps
    from distill.generate import load_examples

    examples = load_examples(sorted(glob.glob(f"{work}/data/heldout/shard-*.pt")))
    if not examples:
        raise SystemExit(f"no held-out shards under {work}/data/heldout")
    model, t2d, d2t = drafter.model, drafter.target_to_draft, drafter.draft_to_target
    shape = tree_shape(drafter, k)
    tokens = steps = 0
    tally = {"nodes": 0, "passes": 0}
    with _counting_passes(model, tally):
        for e in examples:
            if shape is not None:
                steps += eagle_tree_greedy_steps(model, t2d, d2t, e, k, *shape, min_score=drafter.min_score(),
                                                 tally=tally)
            elif getattr(drafter, "uses_target_features", False):
                steps += eagle_greedy_steps(model, t2d, d2t, e, k)
            else:
                steps += greedy_steps(model, t2d, d2t, e["prompt_ids"], e["response_ids"], k)
            tokens += len(e["response_ids"])
    figure = f"{tokens / steps:.3f}"
    if shape is not None:
        figure += f" ({tally['nodes'] / steps:.2f} nodes, {tally['passes'] / steps:.2f} draft passes a step)"
    return figure


@contextlib.contextmanager
def _counting_passes(model, tally: dict):
    """Count the draft's forward passes into tally["passes"] for the duration of the block."""
    forward = model.forward

    def counted(*args, **kwargs):
        tally["passes"] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    try:
        yield
    finally:
        del model.forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default="smollm2-eagle", help="a draft folder or a shipped draft's name")
    parser.add_argument("--variants", default="packed:0,bf16:0,packed:2048,bf16:2048")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1, help="the draft tier's default")
    parser.add_argument("--heldout", default=None, help="a distill work folder: also measure acceptance")
    parser.add_argument("--grow", type=int, default=0, help="tokens the context grows each round (0: fixed)")
    parser.add_argument("--unpadded", action="store_true",
                        help="also run each variant on transformers' KV cache instead of the padded one")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not is_distilled_draft(resolve_draft(args.draft)):
        raise SystemExit(f"{args.draft}: not a distilled or EAGLE draft folder (draft_head_tokens applies to those)")

    variants = {}
    for v in [f"{v}{suffix}" for v in args.variants.split(",") for suffix in ("", " unpadded")[:1 + args.unpadded]]:
        drafter = load(args.draft, v.split()[0])
        state = drafter.new_state(v)
        if v.endswith(" unpadded"):
            from transformers import DynamicCache

            state.cache = DynamicCache(config=drafter.model.config)
        context = list(range(1000, 1000 + args.context))
        if getattr(drafter, "uses_target_features", False):
            state.sync(0, context, None, torch.randn(len(context), drafter.feature_dim))
        else:
            state.sync(0, context)
        drafter.propose(state, args.k, SamplingParams(), 0, 8)
        variants[v] = (drafter, state, [])
        print(f"loaded {v}", flush=True)
    for r in range(args.rounds):
        for v, (drafter, state, times) in variants.items():
            times.append(step(drafter, state, args.k, args.context + (r + 1) * args.grow, args.grow))
    base = statistics.median(next(iter(variants.values()))[2])
    grown = f" (growing {args.grow} a round to {args.context + args.rounds * args.grow})" if args.grow else ""
    print(f"\none Propose of k = {args.k} after {args.context} tokens{grown}, {args.threads} thread(s), "
          f"median of {args.rounds}:")
    for v, (drafter, _, times) in variants.items():
        m = statistics.median(times)
        line = f"  {v:<27} {m * 1e3:6.1f} ms  ({m / base:.2f}x)"
        if args.heldout:
            shape = tree_shape(drafter, args.k)
            what = f"tree of {args.k}, depth {shape[0]}, branch {shape[1]}" if shape else f"chain of {args.k}"
            line += f"   held-out committed tokens/step ({what}): {acceptance(drafter, args.heldout, args.k)}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
