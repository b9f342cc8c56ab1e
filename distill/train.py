"""The distillation loop.

Loss at each response position (and at the last prompt position, which
predicts the first response token): (1 - kd) * cross-entropy on the token the
target produced + kd * cross-entropy against the target's top-k distribution,
restricted to the draft's vocabulary and renormalised. The head runs only at
those positions, so prompt tokens cost a layer forward and no head.

Batches are drawn from a schedule fixed by the seed before the first step, so a
run resumed from a checkpoint takes exactly the batches it would have taken.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

IGNORE = -100


@dataclass
class Example:
    input_ids: torch.Tensor   # [L] int64, draft input ids (prompt + response, last token dropped)
    start: int                # first position whose next token is a response token
    labels: torch.Tensor      # [L - start] int64, draft output ids or IGNORE
    soft_ids: torch.Tensor    # [L - start, K] int64, draft output ids, -1 where outside the subset
    soft_logp: torch.Tensor   # [L - start, K] float32, the target's log-probs of those tokens


def make_examples(raw: Sequence[dict], target_to_draft: torch.Tensor, other_id: int, max_len: int) -> list[Example]:
    examples = []
    for e in raw:
        full = torch.tensor(list(e["prompt_ids"]) + list(e["response_ids"]), dtype=torch.long)[:max_len + 1]
        start = len(e["prompt_ids"]) - 1
        n = len(full) - 1 - start
        if n <= 0:
            continue
        draft = target_to_draft[full]                                                # [L + 1]
        labels = draft[start + 1:].clone()                                           # [n]
        labels[labels == other_id] = IGNORE
        soft_ids = target_to_draft[e["top_ids"][:n].long()]                          # [n, K]
        soft_ids[soft_ids == other_id] = -1
        examples.append(Example(draft[:-1], start, labels, soft_ids, e["top_logp"][:n].float()))
    return examples


def schedule(examples: Sequence[Example], steps: int, batch_tokens: int, seed: int) -> list[list[int]]:
    """`steps` batches of example indices: similar lengths together, about batch_tokens tokens each."""
    rng = random.Random(seed)
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i].input_ids), i))
    batches, current, width = [], [], 0
    for i in order:
        length = len(examples[i].input_ids)
        if current and max(width, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, width = [], 0
        current.append(i)
        width = max(width, length)
    if current:
        batches.append(current)
    plan: list[list[int]] = []
    while len(plan) < steps:
        epoch = batches[:]
        rng.shuffle(epoch)
        plan.extend(epoch)
    return plan[:steps]


def collate(examples: Sequence[Example], device) -> dict:
    width = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)                        # [B, L], right-padded
    mask = torch.zeros(len(examples), width, dtype=torch.long)                       # [B, L]
    rows, cols = [], []
    for b, e in enumerate(examples):
        ids[b, :len(e.input_ids)] = e.input_ids
        mask[b, :len(e.input_ids)] = 1
        positions = torch.arange(e.start, len(e.input_ids))
        rows.append(torch.full_like(positions, b))
        cols.append(positions)
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device),
                rows=torch.cat(rows).to(device), cols=torch.cat(cols).to(device),                   # [N]
                labels=torch.cat([e.labels for e in examples]).to(device),                           # [N]
                soft_ids=torch.cat([e.soft_ids for e in examples]).to(device),                       # [N, K]
                soft_logp=torch.cat([e.soft_logp for e in examples]).to(device))                     # [N, K]


def draft_logits(model, batch: dict) -> torch.Tensor:
    """[N, n_out] logits at the loss positions only (the 'other' bucket dropped)."""
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    picked = hidden[batch["rows"], batch["cols"]]                                    # [N, H]
    return model.lm_head(picked)[:, :-1]                                             # [N, n_out]


def loss_fn(logits: torch.Tensor, batch: dict, kd_weight: float) -> tuple[torch.Tensor, dict]:
    logq = torch.log_softmax(logits.float(), dim=-1)                                 # [N, n_out]
    hard = F.nll_loss(logq, batch["labels"], ignore_index=IGNORE)
    valid = batch["soft_ids"] >= 0                                                   # [N, K]
    p = torch.where(valid, batch["soft_logp"].exp(), torch.zeros_like(batch["soft_logp"]))  # [N, K]
    mass = p.sum(-1, keepdim=True)                                                   # [N, 1]
    keep = mass.squeeze(-1) > 0
    p = p / mass.clamp(min=1e-9)
    logq_k = logq.gather(1, batch["soft_ids"].clamp(min=0))                          # [N, K]
    soft = -(p * logq_k).sum(-1)[keep].mean() if keep.any() else logq.new_zeros(())
    loss = (1 - kd_weight) * hard + kd_weight * soft
    with torch.no_grad():
        labelled = batch["labels"] != IGNORE
        acc = (logits.argmax(-1)[labelled] == batch["labels"][labelled]).float().mean()
    return loss, dict(loss=loss.item(), hard=hard.item(), soft=soft.item(), acc=acc.item())


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def draft_loss(kd_weight: float) -> Callable:
    """The plain draft's batch -> (loss, stats)."""
    def loss_of(model, batch):
        return loss_fn(draft_logits(model, batch), batch, kd_weight)
    return loss_of


def train(model, examples: Sequence, *, steps: int, batch_tokens: int, lr: float, kd_weight: float,
          seed: int, device, checkpoint: Path, checkpoint_every: int,
          progress: Callable[[int, dict], None] = lambda step, stats: None,
          collate_fn: Callable = collate, loss_of: Callable | None = None,
          trainable: Callable[[str], bool] = lambda name: True, precision: str = "fp32") -> dict:
    """Train in place; resume from `checkpoint` when it exists. Returns the last step's stats.

    `collate_fn(examples, device)` and `loss_of(model, batch)` default to the plain draft's; the
    parameters `trainable(name)` rejects stay frozen (an EAGLE draft keeps the target's rows).
    `precision`: "fp32" or "bf16" (distill.precision, resolved): bf16 runs the forward under a bfloat16
    autocast; the weights, the optimizer and the losses' softmaxes stay float32."""
    loss_of = loss_of or draft_loss(kd_weight)
    plan = schedule(examples, steps, batch_tokens, seed)
    model.to(device).train()
    model.requires_grad_(False)
    params = [p for name, p in model.named_parameters() if trainable(name)]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    first, stats = 0, {}
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first = state["step"]
        stats = state.get("stats", {})   # a run resumed after its last step still reports that step
    warmup = max(1, min(50, steps // 10))
    for step in range(first, steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        batch = collate_fn([examples[i] for i in plan[step]], device)
        batch["step"] = step   # for a loss that draws noise: (seed, step) keeps a resumed run's draws
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, stats = loss_of(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        progress(step + 1, stats)
        if (step + 1) % checkpoint_every == 0 or step + 1 == steps:
            tmp = checkpoint.with_suffix(".tmp")
            torch.save(dict(model=model.state_dict(), optimizer=optimizer.state_dict(), step=step + 1,
                            stats=stats), tmp)
            tmp.replace(checkpoint)   # a checkpoint is there whole or not at all
    model.eval()
    model.requires_grad_(False)
    return stats
