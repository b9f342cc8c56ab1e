"""The model card (README.md) of a distilled draft."""
from __future__ import annotations

import shlex
import sys

from distill.evaluate import SERVED_TREE


def command_line(argv: list[str] | None = None) -> str:
    return "specmesh distill " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[2:]))


def render(*, args, argv, target_info, vocab_map, facts, report, timings, data, n_params, size_bytes) -> str:
    rows = []
    tree = all("greedy_committed_per_step_tree_k4" in r for r in report.values()) and bool(report)
    for category, r in report.items():
        rows.append(f"| {category} | {r['answers']} | {r['tokens']} | {r['greedy_committed_per_step_k4']:.2f} | "
                    + (f"{r['greedy_committed_per_step_tree_k4']:.2f} | " if tree else "")
                    + f"{r['greedy_acceptance_k4']:.2f} | "
                    f"{r['sampled_token_acceptance']:.2f} | {r['sampled_committed_per_step_k4']:.2f} |")
    nodes, depth, branch = SERVED_TREE
    tree_note = (f" The tree column is a draft tree of {nodes} nodes (k = {nodes}, like the other columns), grown as "
                 f"the EAGLE drafters grow theirs by default (depth {depth}, {branch} children per expanded node; "
                 f"docs/distill.md, \"Draft trees\")." if tree else "")
    tree_head, tree_rule = (f" committed/step tree k={nodes} |", " --- |") if tree else ("", "")
    phases = ", ".join(f"{name.split()[0]} {seconds / 60:.1f} min" for name, seconds in timings.seconds.items())
    # What the training data hold (a --max-train-batches budget keeps the greedy batches, which come first).
    greedy_share = sum(e["temperature"] == 0 for e in data.train) / max(1, len(data.train))
    eagle = args.arch == "eagle"
    self_written = data.n_self_written
    from_file = data.prompts_file
    n_templates = data.n_prompts - self_written - (from_file["train"] if from_file else 0)
    sources = []       # what the target answered, each source a line of the card's data item
    if n_templates:
        sources.append(f"{n_templates} prompts written from templates x topics over 13\n  Spec-Bench-like categories, "
                       "with passages from the Python reference (`pydoc_data`), standard-library\n  docstrings and "
                       "German gettext catalogues installed on the machine")
    if self_written:
        sources.append(f"{self_written} requests the target wrote itself into its chat template from each "
                       f"category's first words\n  (`--self-prompts-per-category`, distill/self_prompts.py)")
    if from_file:
        sources.append(_file_note(from_file))
    data_sources = ",\n  and to ".join(sources)
    if eagle:
        what = (f"An EAGLE-style draft (specmesh.eagle): {args.layers} decoder layer(s) that read each token together "
                "with the target's feature (last hidden state) at the position before, over")
        serve = ("Serve it with `specmesh serve draft --eagle-model <this folder>` (or `specmesh up --eagle-model ...`); "
                 "requests name the `eagle` drafter.")
        init = (f"the target's embedding rows for those tokens (tied input/output, frozen: they are the target's "
                f"head), its last {args.layers} decoder layer(s) and its final norm; `fc` passes the feature through")
        loss = (f"loss = cross-entropy against the target's distribution over the draft vocabulary (exact, from "
                f"its features) at {'every position, prompt and answer' if args.prompt_positions else 'answer positions'}"
                f" + 0.2 x smooth L1 to its next feature, {args.passes} pass(es) per batch"
                + (" (pass 2 reads the draft's own features, as its later draft tokens do)" if args.passes > 1 else "")
                + (f", the first weighing {args.first_pass_weight:g} of the loss"
                   if args.first_pass_weight is not None and args.passes > 1 else "")
                + (f", the features read with uniform noise in [-{args.feature_noise:g}, {args.feature_noise:g}]"
                   if args.feature_noise else ""))
    else:
        what = f"A {args.layers}-layer draft over"
        serve = "Serve it with `specmesh serve draft --draft-model <this folder>` (or `specmesh up --draft-model ...`)."
        init = (f"the target's embedding rows for those tokens (tied input/output), its first {args.layers} "
                "decoder layer(s) and its final norm")
        loss = (f"loss = {1 - args.kd_weight:.2f} x cross-entropy on the target's tokens + {args.kd_weight:.2f} x "
                "cross-entropy against its top-16 distribution")
    generation_precision = ("in bfloat16 products" if facts.get("generation_precision") == "bf16"
                            else "in float32")
    precision = facts.get("train_precision", "fp32")
    precision = "bfloat16 products (autocast)" if precision == "bf16" else "float32"
    training = (f"training: {args.steps} AdamW steps of about {args.train_batch_tokens} tokens, lr {args.lr} "
                f"(warm-up, cosine), in {precision} (`--train-precision {args.train_precision}`),\n  {loss}; last step: loss {facts['last_step'].get('loss', float('nan')):.3f},\n"
                f"  top-1 agreement {facts['last_step'].get('acc', float('nan')):.3f}.")
    if args.steps == 0:
        training = "training: none (`--steps 0`): the table below measures the starting draft as it is."
    vocab_source = "most frequent answer tokens seen (FR-Spec)"
    if args.init_from is not None:
        from distill.phases import init_digest

        init = (f"the draft `{args.init_from}` (weights and files sha256 {init_digest(args.init_folder)}...): its "
                f"vocabulary, its layers and its weights, trained further on the data above")
        vocab_source = f"tokens of `{args.init_from}` (its vocabulary map, kept)"
    return f"""# Distilled draft for `{target_info.name}`

{what} {len(vocab_map.draft_to_target)} of the target's {target_info.vocab_size} tokens
(plus one input-only "other" bucket), trained by self-distillation with `specmesh distill`.
{serve}

## How it was made

    {command_line(argv)}

- seed {args.seed}, device {facts.get('device', 'cpu')}, torch threads {facts.get('threads')}
- wall time {timings.total / 60:.1f} min ({phases}), summed over interrupted and resumed runs
- data: the target's own answers to {data_sources}; no Spec-Bench question, nothing downloaded. {100 * greedy_share:.0f}% answered greedily, the rest sampled at temperature
  {args.temperature}; at most {args.max_new_tokens} new tokens; {facts['train_tokens']} answer tokens,
  with the target's top-16 log-probabilities at each; generated with {facts.get('generation_kernels', 'stock')} linear
  kernels (`--generation-kernels`) {generation_precision} (`--generation-precision {args.generation_precision}`), finished
  rows {'dropped from' if args.finished_rows == 'drop' else 'kept in'} their batch (`--finished-rows`), sampled tokens drawn by {args.sampler} (`--sampler`);
  held-out answers in float32.
- vocabulary: the {len(vocab_map.draft_to_target)} {vocab_source}; they cover
  {100 * facts['vocab_coverage']:.1f}% of the tokens of the held-out answers.
- initialisation: {init}.
- {training}
- size: {n_params / 1e6:.1f} M parameters, {size_bytes / 1e6:.1f} MB on disk ({args.storage}).

## Measured acceptance (held-out prompts of the same generator{", and of --prompts-file" if from_file else ""}, {data.n_heldout_prompts} answers, greedy)

Committed tokens per step = accepted draft tokens + 1, replaying speculative decoding against the
target's greedy answer. The temperature columns are an estimate: per-token acceptance
sum_x min(p_T, q_T) at T = {args.temperature} along the same answers (p_T from the target's top-16), and the
committed tokens per step it implies at k = 4.{tree_note}

| category | answers | tokens | committed/step k=4 |{tree_head} acceptance k=4 | token acceptance T={args.temperature} | committed/step T={args.temperature} k=4 |
| --- | --- | --- | --- |{tree_rule} --- | --- | --- |
{chr(10).join(rows)}
"""


def _file_note(facts: dict) -> str:
    left_out = "; ".join(f"{n} {reason}" for reason, n in facts["left_out"].items())
    return (f"{facts['train']} of the {facts['requests']} requests in `--prompts-file` {facts['path']}\n"
            f"  (sha256 {facts['sha256'][:16]}..., categories {', '.join(facts['categories'])}; {facts['heldout']} "
            f"more held out for the table below" + (f"; left out: {left_out}" if left_out else "") + ")")
