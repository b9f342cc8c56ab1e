"""Offline acceptance of a draft on held-out prompts (never bench questions).

Greedy: replay speculative decoding against the target's greedy answer. Each
step the draft proposes k tokens greedily from the committed prefix; the
accepted ones are the prefix that matches the target's answer, and the step
commits them plus one target token. Committed tokens per step = answer
length / steps, exactly what the services report for the same answer.

Temperature T: the expected acceptance of one draft token sampled from q_T is
sum_x min(p_T(x), q_T(x)) (Leviathan et al.), taken here with teacher forcing
along the same answers and p_T from the stored top-k target log-probs; with a
per-token rate a, k draft tokens commit (1 - a^(k+1)) / (1 - a) per step.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
from transformers import DynamicCache

from specmesh.distilled import DistilledDraft
from specmesh.eagle import EagleDraft, grow_tree
from specmesh.models import cache_kwargs


@torch.inference_mode()
def greedy_steps(model, target_to_draft: torch.Tensor, draft_to_target: torch.Tensor, prompt: Sequence[int],
                 answer: Sequence[int], k: int) -> int:
    """Speculative steps needed to commit `answer` with greedy drafts of k tokens."""
    device = target_to_draft.device
    cache = DynamicCache(config=model.config)
    committed = list(prompt)
    fed = 0                                    # tokens of `committed` in the cache
    position, steps = 0, 0
    while position < len(answer):
        feed = committed[fed:]
        ids = target_to_draft[torch.tensor([feed], device=device)]                     # [1, T]
        logits = model(input_ids=ids, logits_to_keep=1, **cache_kwargs(model, cache)).logits[0, -1, :-1]
        fed = len(committed)
        drafted = []
        for i in range(k):
            token = int(draft_to_target[logits.argmax()])
            drafted.append(token)
            if i + 1 < k:
                ids = target_to_draft[torch.tensor([[token]], device=device)]
                logits = model(input_ids=ids, **cache_kwargs(model, cache)).logits[0, -1, :-1]
        accepted = 0
        while accepted < k and position + accepted < len(answer) and drafted[accepted] == answer[position + accepted]:
            accepted += 1
        take = min(accepted + 1, len(answer) - position)      # the accepted tokens + one target token
        committed.extend(answer[position:position + take])
        position += take
        steps += 1
        excess = cache.get_seq_length() - fed
        if excess > 0:
            cache.crop(-excess)                # drop the draft tokens; the next step feeds what was committed
    return steps


@torch.inference_mode()
def sampled_rate(model, target_to_draft, draft_to_target, example: dict, temperature: float) -> tuple[float, int]:
    """(sum over positions of sum_x min(p_T, q_T), positions) along the example's answer."""
    device = target_to_draft.device
    full = list(example["prompt_ids"]) + list(example["response_ids"])
    start, n = len(example["prompt_ids"]) - 1, len(example["response_ids"])
    ids = target_to_draft[torch.tensor([full[:-1]], device=device)]                     # [1, L]
    logits = model(input_ids=ids).logits[0, start:start + n, :-1].float()               # [n, n_out]
    q = torch.zeros(n, target_to_draft.shape[0], device=device)                         # [n, V_t]
    q[:, draft_to_target] = torch.softmax(logits / temperature, dim=-1)
    top_ids = example["top_ids"][:n].long().to(device)                                  # [n, K]
    p_top = torch.softmax(example["top_logp"][:n].float().to(device) / temperature, dim=-1)  # [n, K]
    overlap = torch.minimum(p_top, q.gather(1, top_ids)).sum(-1)                        # [n]
    return float(overlap.sum()), n


@torch.inference_mode()
def eagle_replay(model: EagleDraft, target_to_draft: torch.Tensor, example: dict, draft,
                 observe=None) -> int:
    """Speculative steps needed to commit the example's answer with an EAGLE draft. Committed positions
    read the target's features (the example's); each step, `draft(logits, hidden, cache, position)` drafts
    from the draft's output at the last committed one and returns (target ids, parents: a chain or a tree,
    specmesh.tree). The step accepts the nodes that follow the answer down from the root, commits them
    plus one target token, and drops the drafted positions from the cache (they are fed again with real
    features). `observe(accepted, next_token)`, if given, hears each step's outcome while the answer goes on
    past the accepted drafts (tools/outcome_guess.py)."""
    device = target_to_draft.device
    prompt, answer = list(example["prompt_ids"]), list(example["response_ids"])
    features = example["features"].float().to(device)                                # [L - 1, H]
    zero = torch.zeros(1, features.shape[1], device=device)
    cache = DynamicCache(config=model.config)
    committed = list(prompt)
    fed, position, steps = 0, 0, 0
    while position < len(answer):
        n = len(committed)
        ids = target_to_draft[torch.tensor([committed[fed:n]], device=device)]            # [1, T]
        prev = torch.cat([zero, features])[fed:n][None]                                  # [1, T, H]: f_{j-1}
        logits, hidden = model(ids, prev, cache=cache, logits_rows=1)
        fed = n
        drafted, parents = draft(logits[0, -1], hidden[0, -1], cache, n)
        node, accepted = -1, 0
        while position + accepted < len(answer):
            child = next((c for c, parent in enumerate(parents)
                          if parent == node and drafted[c] == answer[position + accepted]), None)
            if child is None:
                break
            node, accepted = child, accepted + 1
        if observe is not None and position + accepted < len(answer):
            observe(accepted, answer[position + accepted])
        take = min(accepted + 1, len(answer) - position)      # the accepted tokens + one target token
        committed.extend(answer[position:position + take])
        position += take
        steps += 1
        excess = cache.get_seq_length() - fed
        if excess > 0:
            cache.crop(-excess)
    return steps


def eagle_greedy_steps(model: EagleDraft, target_to_draft: torch.Tensor, draft_to_target: torch.Tensor,
                       example: dict, k: int) -> int:
    """greedy_steps for an EAGLE draft: a chain of k greedy drafts, each after reading the draft's own
    stand-in feature of the one before."""
    device = target_to_draft.device

    def chain(logits, hidden, cache, position):
        drafted = []
        for i in range(k):
            token = int(logits[:-1].argmax())
            drafted.append(int(draft_to_target[token]))
            if i + 1 < k:
                out, feature = model(torch.tensor([[token]], device=device), hidden[None, None], cache=cache)
                logits, hidden = out[0, -1], feature[0, -1]
        return drafted, list(range(-1, k - 1))

    return eagle_replay(model, target_to_draft, example, chain)


def eagle_tree_greedy_steps(model: EagleDraft, target_to_draft: torch.Tensor, draft_to_target: torch.Tensor,
                            example: dict, size: int, depth: int, branch: int, min_score: float = float("-inf"),
                            tally: dict | None = None) -> int:
    """eagle_greedy_steps with a draft tree (specmesh.eagle.grow_tree, cut at `min_score`): each step walks
    down the tree while a child is the target's next token. `tally["nodes"]`, if given, counts the nodes."""
    device = target_to_draft.device

    def rank(logits):
        return torch.log_softmax(logits[..., :-1].float(), dim=-1)

    def grow(logits, hidden, cache, position):
        drafted, parents = grow_tree(model, cache, position, logits, hidden, size, depth, branch, rank, min_score)
        if tally is not None:
            tally["nodes"] += len(drafted)
        ids = draft_to_target[torch.tensor(drafted, dtype=torch.long, device=device)].tolist() if drafted else []
        return ids, parents

    return eagle_replay(model, target_to_draft, example, grow)


@torch.inference_mode()
def eagle_sampled_rate(model: EagleDraft, target_to_draft, draft_to_target, example: dict,
                       temperature: float) -> tuple[float, int]:
    """sampled_rate with the target's features at every position (the first draft token of a step)."""
    device = target_to_draft.device
    full = list(example["prompt_ids"]) + list(example["response_ids"])
    start, n = len(example["prompt_ids"]) - 1, len(example["response_ids"])
    features = example["features"].float().to(device)                                # [L - 1, H]
    ids = target_to_draft[torch.tensor([full[:-1]], device=device)]                     # [1, L - 1]
    prev = torch.cat([torch.zeros_like(features[:1]), features[:-1]])[None]             # [1, L - 1, H]
    logits, _ = model(ids, prev)
    logits = logits[0, start:start + n, :-1].float()                                    # [n, n_out]
    q = torch.zeros(n, target_to_draft.shape[0], device=device)
    q[:, draft_to_target] = torch.softmax(logits / temperature, dim=-1)
    top_ids = example["top_ids"][:n].long().to(device)
    p_top = torch.softmax(example["top_logp"][:n].float().to(device) / temperature, dim=-1)
    return float(torch.minimum(p_top, q.gather(1, top_ids)).sum()), n


# The card's draft tree: (nodes k, depth, branch) at k = 4, the k of the card's other columns (the
# orchestrator's default k is 5), grown with the draft tier's tree_depth and tree_branch defaults
# (specmesh.config.DraftConfig, which this module does not import: it would bring gRPC into a training
# run; tests/test_distill.py keeps them equal).
SERVED_TREE = (4, 3, 3)


def evaluate(draft: DistilledDraft, heldout: Sequence[dict], ks: Sequence[int] = (4,),
             temperature: float = 0.8, progress=lambda n: None) -> dict:
    """Per category and overall: greedy committed tokens per step at each k (and, for an EAGLE draft,
    with the served draft tree), teacher-forced top-1 agreement, and the estimated committed tokens per
    step at `temperature` (k = 4)."""
    tokens = defaultdict(int)
    steps = defaultdict(lambda: defaultdict(int))
    tree_steps = defaultdict(int)
    overlap, positions = defaultdict(float), defaultdict(int)
    t2d, d2t = draft.target_to_draft, draft.draft_to_target
    for example in heldout:
        cats = (example["category"], "overall")
        answer = example["response_ids"]
        eagle = isinstance(draft.model, EagleDraft)
        for k in ks:
            s = (eagle_greedy_steps(draft.model, t2d, d2t, example, k) if eagle
                 else greedy_steps(draft.model, t2d, d2t, example["prompt_ids"], answer, k))
            for c in cats:
                steps[c][k] += s
        if eagle:
            s = eagle_tree_greedy_steps(draft.model, t2d, d2t, example, *SERVED_TREE)
            for c in cats:
                tree_steps[c] += s
        o, n = (eagle_sampled_rate if eagle else sampled_rate)(draft.model, t2d, d2t, example, temperature)
        for c in cats:
            tokens[c] += len(answer)
            overlap[c] += o
            positions[c] += n
        progress(1)
    report = {}
    for c in sorted(tokens, key=lambda c: (c == "overall", c)):
        rate = overlap[c] / max(1, positions[c])
        report[c] = dict(
            answers=sum(1 for e in heldout if e["category"] == c) if c != "overall" else len(heldout),
            tokens=tokens[c],
            **{f"greedy_committed_per_step_k{k}": tokens[c] / max(1, steps[c][k]) for k in ks},
            **{f"greedy_acceptance_k{k}": (tokens[c] / max(1, steps[c][k]) - 1) / k for k in ks},
            **({"greedy_committed_per_step_tree_k4": tokens[c] / max(1, tree_steps[c])} if tree_steps else {}),
            sampled_token_acceptance=rate,
            sampled_committed_per_step_k4=(1 - rate ** 5) / (1 - rate) if rate < 1 else 5.0,
        )
    return report
