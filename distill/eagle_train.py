"""Training an EAGLE-style draft (specmesh.eagle) on the target's own generations and features.

An example is one generation: the target's features f_0 .. f_{L-2} at every
position of prompt + answer but the last (distill.generate keeps them). At
position j the draft reads (x_j, f_{j-1}) and is trained so that its output h_j

- lands on the target's feature f_j (smooth L1: the next draft step feeds h_j
  back in place of f_j), and
- gives, through the head, the target's own distribution of x_{j+1} over the
  draft vocabulary (cross-entropy against softmax(f_j . head rows): the teacher
  is exact, computed from the feature, no top-k truncation), at answer positions.

With `passes` = 2 each batch runs twice: the second pass reads the draft's
first-pass outputs as its features (x_j, h_{j-1}), which is what the second and
later draft tokens of a step see at serving time; both passes are trained.
The passes weigh the same unless `first_pass_weight` gives the first its own
share (the rest split what is left): the first pass trains the first draft
position, where most accepted tokens are won, and an equal third pass cut its
share from 1/2 to 1/3 (docs/distill.md).

With `feature_noise` = a, every pass reads its features with uniform noise in
[-a, a] added (EAGLE's augmentation, which uses 0.1): at serving time the
draft's later positions read its own imperfect stand-ins, and a draft that
fits its training answers far better than held-out ones may generalise better
when its inputs are not exact. The noise is drawn from (seed, step), so a run
resumed from a checkpoint draws what the uninterrupted one did.

The draft's embedding and head are the target's rows and stay frozen: they are
the teacher's head too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

# EAGLE weighs the regression 1.0 and the token loss 0.1, for millions of training tokens. With the
# few hundred thousand one CPU hour gives, the token loss must lead (it is what acceptance measures);
# the regression keeps h_j usable as the next step's feature.
REG_WEIGHT = 0.2
CE_WEIGHT = 1.0


@dataclass
class EagleExample:
    input_ids: torch.Tensor   # [L - 1] int64, draft ids of positions 0 .. L-2
    features: torch.Tensor    # [L - 1, H] float16, the target's f_0 .. f_{L-2}
    start: int                # first position whose next token is an answer token


def make_examples(raw: Sequence[dict], target_to_draft: torch.Tensor, max_len: int) -> list[EagleExample]:
    examples = []
    for e in raw:
        full = torch.tensor(list(e["prompt_ids"]) + list(e["response_ids"]), dtype=torch.long)
        features = e["features"]
        n = min(len(full) - 1, len(features), max_len)
        start = len(e["prompt_ids"]) - 1
        if n <= start:
            continue
        examples.append(EagleExample(target_to_draft[full[:n]], features[:n], start))
    return examples


def collate(examples: Sequence[EagleExample], device) -> dict:
    width = max(len(e.input_ids) for e in examples)
    hidden = examples[0].features.shape[-1]
    ids = torch.zeros(len(examples), width, dtype=torch.long)                     # [B, L], right-padded
    mask = torch.zeros(len(examples), width, dtype=torch.long)                    # [B, L]
    feats = torch.zeros(len(examples), width, hidden)                             # [B, L, H]
    answer = torch.zeros(len(examples), width, dtype=torch.bool)                  # [B, L]
    for b, e in enumerate(examples):
        n = len(e.input_ids)
        ids[b, :n], mask[b, :n] = e.input_ids, 1
        feats[b, :n] = e.features.float()
        answer[b, e.start:n] = True
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), features=feats.to(device),
                answer=answer.to(device))


def shifted(features: torch.Tensor) -> torch.Tensor:
    """[B, L, H] features at positions j -> the feature before each position (zeros at 0)."""
    return torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)


def pass_weights(passes: int, first_pass_weight: float | None = None) -> list[float] | None:
    """Each pass's weight in the loss; None: equal weights (the sum divided by `passes`)."""
    if first_pass_weight is None or passes == 1:
        return None
    return [first_pass_weight] + [(1.0 - first_pass_weight) / (passes - 1)] * (passes - 1)


def eagle_loss(passes: int, teacher_head: torch.Tensor, prompt_positions: bool = False,
               first_pass_weight: float | None = None, feature_noise: float = 0.0, seed: int = 0) -> Callable:
    """batch -> (loss, stats) for `model` (EagleDraft); teacher_head [n_out, H]: the target's output rows.

    With `prompt_positions` the token loss covers the prompt's positions too: the target's distribution
    of the next token is in its feature there as much as in the answer, so the same generations give
    more (and more varied) teaching positions; answers alone are what the draft is served on.
    `first_pass_weight`, `feature_noise`: see the module docstring (None: every pass weighs 1 / passes;
    0: no noise). Noise needs the batch's "step" (distill.train.train sets it)."""
    weights = pass_weights(passes, first_pass_weight)

    def loss_of(model, batch):
        target = batch["features"]                                                   # [B, L, H]
        valid = batch["attention_mask"].bool()                                       # [B, L]
        answer = valid if prompt_positions else batch["answer"]                      # [B, L]
        # The teacher in float32 under a bf16 autocast too: rounding its logits to bfloat16 (~0.1 at their
        # size) would blur the very distribution the draft is taught.
        with torch.no_grad(), torch.autocast(target.device.type, enabled=False):
            teacher = torch.softmax(target[answer] @ teacher_head.T, dim=-1)         # [N, n_out]
            teacher_top = teacher.argmax(-1)                                          # [N]
        prev = shifted(target)
        total, stats = 0.0, {}
        noise = None
        if feature_noise:
            noise = torch.Generator(device=target.device).manual_seed(seed * 1_000_003 + batch["step"])
        for p in range(passes):
            if noise is not None:
                prev = prev + (2 * torch.rand(prev.shape, generator=noise, device=prev.device) - 1) * feature_noise
            _, hidden = model(batch["input_ids"], prev, attention_mask=batch["attention_mask"])   # [B, L, H]
            reg = F.smooth_l1_loss(hidden[valid], target[valid])
            logits = model.lm.lm_head(hidden[answer])[:, :-1]                        # [N, n_out]
            logits = logits.float()   # a no-op in float32; under bf16 autocast the softmax wants float32 anyway
            ce = -(teacher * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            term = REG_WEIGHT * reg + CE_WEIGHT * ce
            total = total + (term if weights is None else weights[p] * term)
            with torch.no_grad():
                acc = (logits.argmax(-1) == teacher_top).float().mean().item()
            stats.update({f"reg{p}": reg.item(), f"ce{p}": ce.item(), f"acc{p}": acc})
            prev = shifted(hidden.detach())
        if weights is None:   # the shipped drafts' sum, kept as it was so that they reproduce bit for bit
            total = total / passes
        stats.update(loss=total.item(), acc=stats["acc0"])
        return total, stats
    return loss_of


def trainable(name: str) -> bool:
    """The target's rows (the tied embedding and head) stay as they are."""
    return "embed_tokens" not in name and "lm_head" not in name
