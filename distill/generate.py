"""The target's own generations, the training data of self-distillation.

Prompts are rendered with the target's chat template (as the orchestrator
renders a chat request) and sampled in left-padded batches with a KV cache.
Each step keeps the target's top-k log-probabilities (at temperature 1, from
the full softmax), so the distillation loss never runs the target again.

A batch is one shard file; a run that was interrupted skips the shards already
written. Each batch draws from its own generator seeded by (seed, batch index),
so the data are the same whether or not the run was resumed.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import DynamicCache

from distill.prompts import Prompt
from specmesh.models import cache_kwargs
from specmesh.sampling import sample_rows


@dataclass(frozen=True)
class GenerationPlan:
    max_new_tokens: int = 160
    batch_size: int = 32
    greedy_fraction: float = 0.6     # greedy matters most (the benchmark is greedy); the rest at temperature
    temperature: float = 0.8
    top_k_stored: int = 16           # target log-probs kept per position for the KD loss
    max_prompt_tokens: int = 384
    drop_finished_rows: bool = True  # see COMPACT_WHEN_FINISHED; False: every row runs to the batch's end
    sampler: str = "inverse-cdf"     # see SAMPLERS


def render(tokenizer, prompt: Prompt) -> list[int]:
    if tokenizer.chat_template is None:
        return tokenizer.encode(prompt.text, add_special_tokens=False)
    turns = prompt.messages or (("user", prompt.text),)
    rendered = tokenizer.apply_chat_template([{"role": role, "content": content} for role, content in turns],
                                             add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def plan_batches(tokenizer, prompts: Sequence[Prompt], plan: GenerationPlan, seed: int) -> list[list[dict]]:
    """Examples (prompt ids + decoding temperature) grouped into length-sorted batches."""
    rng = random.Random(seed)
    examples = []
    for index, prompt in enumerate(prompts):
        ids = render(tokenizer, prompt)
        if len(ids) > plan.max_prompt_tokens:
            continue
        temperature = 0.0 if rng.random() < plan.greedy_fraction else plan.temperature
        examples.append(dict(index=index, category=prompt.category, prompt_ids=ids, temperature=temperature))
    # Similar lengths share a batch (little padding); greedy and sampled rows never share one.
    examples.sort(key=lambda e: (e["temperature"], len(e["prompt_ids"]), e["index"]))
    return [examples[i:i + plan.batch_size] for i in range(0, len(examples), plan.batch_size)]


# How a sampled row draws its next token. Both draw from the same distribution; their draws differ.
# "inverse-cdf": one uniform a row and step, and the token whose interval of the cumulative probabilities
#   holds it.
# "multinomial": torch.multinomial, which on a CPU reads an exponential for every token of the vocabulary
#   and row (48 x 49k a step): 44 ms of a 170 ms 48-row decode step on the 2-core build machine, a
#   quarter of every sampled step, and all of it still paid after finished rows leave the batch.
#   How work folders made before the choice were generated (distill.run.data_key).
SAMPLERS = ("inverse-cdf", "multinomial")


def draw_tokens(probs: torch.Tensor, rows: torch.Tensor, n: int, generator: torch.Generator,
                sampler: str) -> torch.Tensor:
    """[R, V] probabilities of the R rows still in the batch (`rows`: their rows among the batch's n) ->
    [R] tokens, on the generator's device. Each draw reads what it would read with all n rows present, so
    a row's tokens do not depend on which others have finished."""
    if sampler == "inverse-cdf":   # the services' own draw (specmesh.sampling.sample), a row at a time
        u = torch.rand(n, generator=generator, device=generator.device, dtype=torch.float64)   # [B]
        return sample_rows(probs.to(generator.device), u[rows.to(generator.device)])       # [R]
    if sampler != "multinomial":
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    probs, rows = probs.to(generator.device), rows.to(generator.device)
    if len(rows) < n:   # dropped rows draw from a uniform stand-in, so the live rows keep their draws
        full = torch.ones(n, probs.shape[-1], device=generator.device)                     # [B, V]
        full[rows] = probs
        probs = full
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)[rows]                # [R]


# A batch drops its finished rows from the forward and the KV cache once a quarter of them have finished:
# a batch decodes until its longest row ends, and a step's cost grows with the rows it carries (on the
# 2-core CPU ~17 ms + 1.7 ms a row). Dropping rows one at a time would copy the cache too often. The
# rows' tokens come out the same, but a forward over fewer rows rounds some positions' features and
# log-probs differently in the last bit (stock attention picks its blocking by batch shape), so data
# made either way live in separate work folders (distill.run.data_key).
COMPACT_WHEN_FINISHED = 0.25


@torch.inference_mode()
def generate_batch(model, batch: list[dict], plan: GenerationPlan, eos_ids: Sequence[int], pad_id: int,
                   generator: torch.Generator) -> list[dict]:
    """The batch's answers, top-k log-probs and features. With `plan.drop_finished_rows`, finished rows
    leave the forward (and the cache) as the batch runs. Sampling still draws for every row of the batch
    at every step, live or not (a multinomial draw reads one exponential per token and row whatever the
    probabilities), so each row's draws are the ones it gets with all rows kept."""
    device = model.device
    n = len(batch)
    lengths = [len(e["prompt_ids"]) for e in batch]
    width = max(lengths)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)                        # [B, L], left-padded
    mask = torch.zeros((n, width), dtype=torch.long)                                    # [B, L]
    for row, e in enumerate(batch):
        input_ids[row, width - lengths[row]:] = torch.tensor(e["prompt_ids"])
        mask[row, width - lengths[row]:] = 1
    input_ids, mask = input_ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)                                      # [B, L]
    temperature = batch[0]["temperature"]
    cache = DynamicCache(config=model.config)
    # The base model's last hidden state (what the LM head reads) is kept at every position too: the
    # features an EAGLE-style draft is trained to continue (specmesh.eagle).
    hidden = model.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                         **cache_kwargs(model.model, cache)).last_hidden_state          # [B, L, H]
    if cache.get_seq_length() != width:
        # Data from a model that forgot its context look like data (on-topic first token, then a loop):
        # refuse them rather than train a draft on them.
        raise RuntimeError(f"the target's forward left the KV cache at {cache.get_seq_length()} tokens after a "
                           f"{width}-token prompt: this transformers version does not take the cache as passed")
    features = [hidden.to(torch.float16).cpu()]
    logits = model.lm_head(hidden[:, -1]).float()                                       # [R, V], R rows in the cache
    eos = torch.tensor(list(eos_ids), device=device)
    rows = torch.arange(n, device=device)                                               # [R] batch row of each cache row
    live = torch.ones(n, dtype=torch.bool, device=device)                               # [R] not finished yet
    tokens, top_ids, top_logp = [], [], []
    for step in range(plan.max_new_tokens):
        logp = torch.log_softmax(logits, dim=-1)                                        # [R, V]
        values, ids = logp.topk(plan.top_k_stored, dim=-1)                              # [R, K]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)                         # [R, V]
            # Drawn on the generator's device: a CPU multinomial over 49k tokens x 256 rows took 0.5 s a
            # step beside a GPU target (12x the greedy step).
            token = draw_tokens(probs, rows, n, generator, plan.sampler).to(device)          # [R]
        else:
            token = logits.argmax(dim=-1)                                               # [R]
        token = torch.where(live, token, torch.full_like(token, pad_id))
        step_tokens = torch.full((n,), pad_id, dtype=torch.long, device=device)
        step_ids = torch.zeros(n, plan.top_k_stored, dtype=torch.int32, device=device)
        step_logp = torch.zeros(n, plan.top_k_stored, dtype=torch.float16, device=device)
        step_tokens[rows], step_ids[rows], step_logp[rows] = token, ids.to(torch.int32), values.to(torch.float16)
        tokens.append(step_tokens)
        top_ids.append(step_ids)
        top_logp.append(step_logp)
        live &= ~torch.isin(token, eos)
        if not bool(live.any()) or step == plan.max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)                   # [R, L + t]
        positions = positions[:, -1:] + 1                                               # [R, 1]
        running = int(live.sum())
        # At least two rows stay: with packed weights a lone row takes MKL's matrix-vector path, which took
        # longer a step than four rows through oneDNN (41 against 25 ms, the 2-core CPU).
        if plan.drop_finished_rows and len(rows) - running >= COMPACT_WHEN_FINISHED * len(rows) and running >= 2:
            keep = live.nonzero().squeeze(1)                                            # [R']
            cache.batch_select_indices(keep)
            rows, live, token, mask, positions = rows[keep], live[keep], token[keep], mask[keep], positions[keep]
        hidden = model.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                             **cache_kwargs(model.model, cache)).last_hidden_state     # [R, 1, H]
        step_features = torch.zeros(n, 1, hidden.shape[-1], dtype=torch.float16)       # [B, 1, H]
        step_features[rows.cpu()] = hidden.to(torch.float16).cpu()
        features.append(step_features)
        logits = model.lm_head(hidden[:, -1]).float()                                   # [R, V]
    tokens_t = torch.stack(tokens, 1).cpu()                                             # [B, T]
    ids_t, logp_t = torch.stack(top_ids, 1).cpu(), torch.stack(top_logp, 1).cpu()       # [B, T, K]
    features_t = torch.cat(features, dim=1)                                            # [B, L + T', H]
    out = []
    for row, e in enumerate(batch):
        response = tokens_t[row].tolist()
        length = len(response)
        for t, tok in enumerate(response):
            if tok in eos_ids:
                length = t + 1          # keep the EOS: the draft should learn to propose it too
                break
        # Features of the prompt and of every response token but the last (never fed to the target).
        first = width - lengths[row]
        out.append(dict(e, response_ids=response[:length], top_ids=ids_t[row, :length].clone(),
                        top_logp=logp_t[row, :length].clone(),
                        features=features_t[row, first:width + length - 1].clone()))
    return out


def generate_shards(model, tokenizer, eos_ids: Sequence[int], prompts: Sequence[Prompt], folder: Path,
                    plan: GenerationPlan, seed: int, progress: Callable[[int], None] = lambda n: None,
                    limit: int | None = None) -> list[Path]:
    """Write (or find, after an interrupt) one shard per batch under `folder`; return their paths.
    With `limit`, only the first `limit` batches (the plan is the same, so the shards are too)."""
    folder.mkdir(parents=True, exist_ok=True)
    batches = plan_batches(tokenizer, prompts, plan, seed)[:limit]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    paths = []
    for number, batch in enumerate(batches):
        path = folder / f"shard-{number:05d}.pt"
        paths.append(path)
        if not path.exists():
            generator = torch.Generator(device=model.device).manual_seed(seed * 1_000_003 + number)
            examples = generate_batch(model, batch, plan, eos_ids, pad_id, generator)
            tmp = path.with_suffix(".tmp")
            torch.save(examples, tmp)
            tmp.rename(path)     # a shard is there whole or not at all
        progress(len(batch))
    return paths


def load_examples(paths: Sequence[Path]) -> list[dict]:
    examples = []
    for path in paths:
        examples.extend(torch.load(path, weights_only=False))
    examples.sort(key=lambda e: e["index"])
    return examples
