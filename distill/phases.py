"""The phases of `specmesh distill`, each resumable from the work folder."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from distill.generate import GenerationPlan, generate_shards, load_examples
from distill.precision import products_in
from distill.prompts import CATEGORIES, Prompt, build_prompts

log = logging.getLogger("specmesh.distill")


@dataclass
class Data:
    train: list[dict]
    heldout: list[dict]
    n_prompts: int
    n_heldout_prompts: int
    n_self_written: int = 0      # of n_prompts: answers to requests the target wrote itself
    prompts_file: dict | None = None   # --prompts-file: what was read, trained on, held out and left out


def split_prompts(args) -> tuple[list[Prompt], list[Prompt]]:
    """Held-out prompts are the first few of each category; they never reach training."""
    prompts = build_prompts(args.prompts_per_category + args.heldout_per_category, args.seed)
    heldout, train, taken = [], [], {c: 0 for c in CATEGORIES}
    for prompt in prompts:
        if taken[prompt.category] < args.heldout_per_category:
            taken[prompt.category] += 1
            heldout.append(prompt)
        else:
            train.append(prompt)
    return train, heldout


def make_data(args, target, work: Path, precision: str = "fp32") -> Data:
    """The target's generations: training data with its products in `precision` (the resolved
    --generation-precision), held-out answers always in float32, the target the verifier serves."""
    train_prompts, heldout_prompts = split_prompts(args)
    drop = args.finished_rows == "drop"
    plan = GenerationPlan(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                          greedy_fraction=args.greedy_fraction, temperature=args.temperature, drop_finished_rows=drop,
                          max_prompt_tokens=args.max_prompt_tokens, sampler=args.sampler)
    heldout_plan = GenerationPlan(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                  greedy_fraction=1.0, drop_finished_rows=drop, max_prompt_tokens=args.max_prompt_tokens)
    limit = args.max_train_batches
    total = min(len(train_prompts), limit * plan.batch_size if limit else len(train_prompts)) + len(heldout_prompts)
    with tqdm(total=total, desc="target generations", unit="prompt", dynamic_ncols=True) as bar:
        with products_in(target.model, precision):
            train_paths = generate_shards(target.model, target.tokenizer, target.info.eos_token_ids, train_prompts,
                                          work / "data" / "train", plan, args.seed, bar.update, limit=limit)
        heldout_paths = generate_shards(target.model, target.tokenizer, target.info.eos_token_ids, heldout_prompts,
                                        work / "data" / "heldout", heldout_plan, args.seed + 1, bar.update)
    train, heldout = load_examples(train_paths), load_examples(heldout_paths)
    self_written = _self_written_data(args, target, work, plan, precision)
    train += self_written
    from_file, heldout_from_file, file_facts = _prompts_file_data(args, target, work, plan, heldout_plan, precision)
    train += from_file
    heldout += heldout_from_file
    tokens = sum(len(e["response_ids"]) for e in train)
    log.info("%d training generations (%d tokens), %d held-out", len(train), tokens, len(heldout))
    return Data(train, heldout, len(train), len(heldout), len(self_written), file_facts)


def _prompts_file_data(args, target, work: Path, plan: GenerationPlan, heldout_plan: GenerationPlan,
                       precision: str = "fp32") -> tuple[list[dict], list[dict], dict | None]:
    """The target's answers to the requests of --prompts-file (distill.prompts_file): training answers,
    held-out answers (greedy, for the card) and what the card says about the file. Like the self-written
    requests they live in a folder of their own, named for the file's bytes."""
    source = args.prompts_source
    if source is None:
        return [], [], None
    folder = work / "data" / source.folder_name
    with tqdm(total=len(source.train) + len(source.heldout), desc="target answers --prompts-file", unit="prompt",
              dynamic_ncols=True) as bar:
        with products_in(target.model, precision):
            train = load_examples(generate_shards(target.model, target.tokenizer, target.info.eos_token_ids,
                                                  source.train, folder / "train", plan, args.seed + 4, bar.update))
        heldout = load_examples(generate_shards(target.model, target.tokenizer, target.info.eos_token_ids,
                                                source.heldout, folder / "heldout", heldout_plan, args.seed + 5,
                                                bar.update))
    dropped = dict(source.dropped)
    too_long = len(source.train) + len(source.heldout) - len(train) - len(heldout)
    if too_long:
        dropped[f"longer than {args.max_prompt_tokens} tokens rendered (--max-prompt-tokens)"] = too_long
    for reason, n in dropped.items():
        log.warning("--prompts-file: %d of %d requests left out: %s", n, source.lines, reason)
    log.info("--prompts-file %s: %d answers to train on (%d tokens), %d held out", source.path, len(train),
             sum(len(e["response_ids"]) for e in train), len(heldout))
    facts = dict(path=str(source.path), sha256=source.sha256, requests=source.lines, train=len(train),
                 heldout=len(heldout), left_out=dropped,
                 categories=sorted({p.category for p in source.train + source.heldout}))
    return train, heldout, facts


def _self_written_data(args, target, work: Path, plan: GenerationPlan, precision: str = "fp32") -> list[dict]:
    """Answers to requests the target wrote itself (distill.self_prompts), training only. They live in
    their own folder under the work folder, so adding them reuses the template answers already there."""
    n = args.self_prompts_per_category
    if not n:
        return []
    from distill.self_prompts import BenchFilter, write_prompts
    from specmesh import spec_bench

    folder = work / "data" / f"self-{n}"
    folder.mkdir(parents=True, exist_ok=True)
    with tqdm(total=0, desc="target writes requests", unit="request", dynamic_ncols=True) as bar, \
            products_in(target.model, precision):
        def planned(rows: int) -> None:          # each round adds what it will sample to the bar
            bar.total += rows
            bar.refresh()

        prompts = write_prompts(target.model, target.tokenizer, target.info.eos_token_ids, n, args.seed + 2,
                                args.batch_size, folder / "prompts.json", BenchFilter(spec_bench.QUESTIONS), bar.update,
                                planned, drop_finished_rows=plan.drop_finished_rows, sampler=plan.sampler)
    with tqdm(total=len(prompts), desc="target answers them", unit="prompt", dynamic_ncols=True) as bar, \
            products_in(target.model, precision):
        paths = generate_shards(target.model, target.tokenizer, target.info.eos_token_ids, prompts,
                                folder / "answers", plan, args.seed + 3, bar.update)
    examples = load_examples(paths)
    log.info("%d answers to self-written requests (%d tokens)", len(examples),
             sum(len(e["response_ids"]) for e in examples))
    return examples


def train_key(args, precision: str = "fp32") -> str:
    """Names the checkpoint folder: every argument that changes training (float32 keeps the names it had
    before --train-precision)."""
    key = f"v{args.vocab}-l{args.layers}-s{args.steps}-b{args.train_batch_tokens}-lr{args.lr}"
    if precision != "fp32":
        key += f"-{precision}"
    if args.init_from is not None:
        key += f"-init{init_digest(args.init_folder)}"
    if args.self_prompts_per_category:
        key += f"-self{args.self_prompts_per_category}"
    if args.prompts_source is not None:
        key += f"-{args.prompts_source.folder_name}"
    if args.arch != "eagle":
        return key + f"-kd{args.kd_weight}"
    first = args.first_pass_weight
    return (key + f"-eagle-p{args.passes}" + (f"-w{first}" if first is not None else "")
            + ("-pp" if args.prompt_positions else "")
            + (f"-n{args.feature_noise:g}" if args.feature_noise else ""))


def init_digest(folder: Path) -> str:
    """Names a starting draft by its bytes: training from a retrained draft of the same name starts afresh."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file()):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def _starting_draft(args, target):
    """--init-from: (model in float32, its VocabMap); a draft for another target is refused naming both."""
    from distill.run import DistillError
    from specmesh.distilled import load_draft
    from specmesh.eagle import load_eagle
    from specmesh.models import ModelLoadError, VocabularyMismatch

    loader = load_eagle if args.arch == "eagle" else load_draft
    try:
        draft = loader(str(args.init_folder), target=target.info)
    except (ModelLoadError, VocabularyMismatch) as error:
        raise DistillError(f"--init-from {args.init_from}: {error}") from None
    return draft.model.float(), draft.vocab_map


def train(args, target, data: Data, work: Path, device: str, precision: str = "fp32"):
    """Choose the vocabulary, build the draft from the target (or start from --init-from's), distill in
    `precision` ("fp32" or "bf16": distill.train.resolve_precision); -> (model, VocabMap, facts)."""
    import torch

    from distill.draft_model import build_draft
    from distill.train import make_examples, train as run_training
    from distill.vocab import choose_vocab
    from specmesh.distilled import VocabMap

    start = _starting_draft(args, target) if args.init_from is not None else None
    if start is not None:
        draft_to_target = list(start[1].draft_to_target)
    else:
        size = min(args.vocab, target.info.vocab_size + 1)
        draft_to_target, _ = choose_vocab(data.train, size, target.info.eos_token_ids)
    chosen = set(draft_to_target)
    heldout_tokens = [t for e in data.heldout for t in e["response_ids"]]
    # Coverage of answers the choice never saw: what the draft can propose at all.
    coverage = sum(t in chosen for t in heldout_tokens) / max(1, len(heldout_tokens))
    vocab_map = VocabMap(target.info.name, target.info.vocab_size, target.info.vocab_fingerprint,
                         tuple(draft_to_target), tuple(target.info.eos_token_ids), target.info.max_context)
    log.info("draft vocabulary: %d target tokens cover %.1f%% of the target's held-out answer tokens",
             len(draft_to_target), 100 * coverage)
    torch.manual_seed(args.seed)
    options = {}
    if args.arch == "eagle":
        from distill import eagle_train
        from distill.draft_model import build_eagle

        model = start[0] if start is not None else build_eagle(target.model, draft_to_target, args.layers)
        examples = eagle_train.make_examples(data.train, vocab_map.target_to_draft(), max_len=args.max_new_tokens + 512)
        rows = target.model.get_output_embeddings().weight.detach().float()[torch.tensor(draft_to_target)]
        options = dict(collate_fn=eagle_train.collate, loss_of=eagle_train.eagle_loss(args.passes, rows.to(device),
                                                                                    args.prompt_positions,
                                                                                    args.first_pass_weight,
                                                                                    args.feature_noise,
                                                                                    args.seed),
                       trainable=eagle_train.trainable)
    else:
        model = start[0] if start is not None else build_draft(target.model, draft_to_target, args.layers)
        examples = make_examples(data.train, vocab_map.target_to_draft(), vocab_map.other_id,
                                 max_len=args.max_new_tokens + 512)
    log.info("training in %s (--train-precision %s)", precision, args.train_precision)
    folder = work / f"train-{train_key(args, precision)}"
    folder.mkdir(parents=True, exist_ok=True)
    with tqdm(total=args.steps, desc="distilling", unit="step", dynamic_ncols=True) as bar:
        def progress(step, stats):
            bar.n = step
            bar.set_postfix(loss=f"{stats['loss']:.3f}", acc=f"{stats['acc']:.3f}", refresh=False)
            bar.refresh()

        last = run_training(model, examples, steps=args.steps, batch_tokens=args.train_batch_tokens, lr=args.lr,
                            kd_weight=args.kd_weight, seed=args.seed, device=device,
                            checkpoint=folder / "checkpoint.pt", checkpoint_every=args.checkpoint_every,
                            progress=progress, precision=precision, **options)
    facts = dict(vocab_coverage=coverage, train_examples=len(examples), last_step=last, train_precision=precision,
                 train_tokens=sum(len(e["response_ids"]) for e in data.train))
    return model.to(device), vocab_map, facts


def evaluate(args, target, model, vocab_map, data: Data, device: str) -> dict:
    import torch

    from distill.evaluate import evaluate as run_evaluation
    from specmesh.distilled import DistilledDraft, fake_quantize

    if args.storage == "int8":
        fake_quantize(model)      # measure what ships

    draft = DistilledDraft(model, vocab_map, target.info, vocab_map.target_to_draft().to(device),
                           torch.tensor(vocab_map.draft_to_target, dtype=torch.long, device=device))
    with tqdm(total=len(data.heldout), desc="held-out acceptance", unit="answer", dynamic_ncols=True) as bar:
        report = run_evaluation(draft, data.heldout, temperature=args.temperature, progress=bar.update)
    overall = report["overall"]
    log.info("held-out: greedy committed tokens per step %.2f (k=4); at T=%.1f about %.2f (k=4)",
             overall["greedy_committed_per_step_k4"], args.temperature,
             overall["sampled_committed_per_step_k4"])
    return report


def save(args, argv, target, model, vocab_map, facts, report, timings, data: Data, folder: Path) -> None:
    import json

    from distill import card
    from specmesh.distilled import save_draft

    n_params = sum(p.numel() for p in model.parameters())
    extra = dict(command=card.command_line(argv), seed=args.seed, steps=args.steps, facts=facts, arch=args.arch,
                 timings=timings.seconds, acceptance=report)
    model = model.cpu()
    eagle = args.arch == "eagle"
    save_draft(folder, model.lm if eagle else model, vocab_map, card="",
               extra=json.loads(json.dumps(extra, default=str)), storage=args.storage)
    if eagle:
        from specmesh.eagle import save_fc

        save_fc(folder, model, args.storage)
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    (folder / "README.md").write_text(card.render(
        args=args, argv=argv, target_info=target.info, vocab_map=vocab_map, facts=facts, report=report,
        timings=timings, data=data, n_params=n_params, size_bytes=size))
