"""`specmesh distill`: the command, its arguments and the order of the phases.

    prompts -> target generations (shards) -> draft vocabulary -> training (checkpoints)
    -> held-out acceptance -> the draft folder (written to a temp sibling, renamed at the end)

Everything but the output folder lives in a work folder (default: under the
specmesh cache, named for the target, the seed and the data settings), so
running the same command again after an interrupt resumes where it stopped.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger("specmesh.distill")

DEFAULTS = dict(prompts_per_category=24, heldout_per_category=4, max_new_tokens=128, max_prompt_tokens=384,
                batch_size=48, greedy_fraction=0.6, temperature=0.8, vocab=8192, layers=2, arch="lm", passes=2, steps=300, train_batch_tokens=1024,
                lr=1e-3, kd_weight=0.5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="smollm2", help="the target model (any spec `--model` accepts)")
    p.add_argument("--out", type=Path, required=True, help="the draft folder to write (must not exist, or --force)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--seed", type=int, default=0, help="prompts, sampling, initialisation and batches follow it")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="generations and checkpoints, kept for resuming (default: under the specmesh cache)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's choice; 1 is faster on a CPU shared with other jobs)")
    p.add_argument("--prompts-per-category", type=int, default=DEFAULTS["prompts_per_category"],
                   help="training prompts per Spec-Bench-like category (13 categories)")
    p.add_argument("--self-prompts-per-category", type=int, default=0,
                   help="also train on requests the target writes itself, this many per category: its chat "
                        "template's user turn, opened with a category's first words, sampled to the end "
                        "(distill/self_prompts.py). Wider than the templates; answered like them; training only. "
                        "Needs a target with a chat template; 0: none")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="also train on your own requests: a JSONL file, one request a line, as a string, "
                        "{\"prompt\": ...}, {\"messages\": [...]} (OpenAI chat) or {\"conversations\": [...]} "
                        "(ShareGPT), with an optional \"category\" (distill/prompts_file.py). The target answers "
                        "each up to its last user turn; --heldout-per-category of each category are held out for "
                        "the card. With it, --prompts-per-category may be 0 (train on the file alone)")
    p.add_argument("--heldout-per-category", type=int, default=DEFAULTS["heldout_per_category"],
                   help="held-out prompts per category, for the acceptance in the model card")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"])
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULTS["max_prompt_tokens"],
                   help="requests longer than this, rendered with the chat template, are left out (counted in the "
                        "log and the card); longer ones cost memory and time in every generation batch")
    p.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="prompts per generation batch")
    p.add_argument("--generation-kernels", choices=("packed", "stock"), default="packed",
                   help="how the target's linear layers run while it generates the data: packed (weights pre-packed "
                        "once for oneDNN, specmesh/fast_linear.py: on a CPU a 48-row decode step multiplies thin "
                        "matrices, which MKL re-packs every call; 1.6-1.9x faster on this project's 2-core build "
                        "machine, the same greedy answers) or stock (torch's nn.Linear: how work folders made "
                        "before this option were generated). A no-op on a GPU")
    p.add_argument("--finished-rows", choices=("drop", "keep"), default="drop",
                   help="what a generation batch does with rows that have finished: drop them from its forward "
                        "and KV cache (a batch decodes until its longest row ends; dropping made writing "
                        "requests (--self-prompts-per-category) ~1.6x faster on this project's 2-core build "
                        "machine, the same tokens) or keep them to the end (how work folders made before this "
                        "option were generated; a few features round differently in the last bit, so each has "
                        "its own work folder)")
    p.add_argument("--sampler", choices=("inverse-cdf", "multinomial"), default="inverse-cdf",  # generate.SAMPLERS
                   help="how a sampled generation draws each token, from the same distribution either way: "
                        "inverse-cdf (one uniform a row and step, the token whose cumulative-probability interval "
                        "holds it; 1.5x the tokens/s of multinomial when the target writes requests on this "
                        "project's 2-core build machine) or multinomial (torch.multinomial, an exponential for every "
                        "token of the vocabulary and row: how work folders made before this option were generated)")
    p.add_argument("--generation-precision", choices=("auto", "fp32", "bf16"), default="auto",  # precision.PRECISIONS
                   help="the target's linear products while it generates training data (its answers, and the "
                        "requests it writes): bf16 (1.27-1.29x the greedy answer tokens/s on this project's "
                        "AVX512-BF16 build machine; the weights, attention and sampling stay float32), fp32 (how "
                        "work folders made before this option were generated), or auto: bf16 where the device "
                        "multiplies bfloat16 natively, else fp32. The held-out answers the card measures "
                        "acceptance on are always generated in float32, as the verifier serves the target")
    p.add_argument("--max-train-batches", type=int, default=None,
                   help="generate and train on only the first N training batches of the plan (they come greedy "
                        "first, shortest prompts first); a later run with a larger N, or none, extends the same "
                        "work folder. For a data budget on a slow machine")
    p.add_argument("--greedy-fraction", type=float, default=DEFAULTS["greedy_fraction"],
                   help="share of prompts answered greedily; the rest are sampled at --temperature")
    p.add_argument("--temperature", type=float, default=DEFAULTS["temperature"])
    p.add_argument("--vocab", type=int, default=DEFAULTS["vocab"],
                   help="draft vocabulary, at most: the most frequent target output tokens seen in the data, "
                        "plus one 'other' input bucket")
    p.add_argument("--arch", choices=("lm", "eagle"), default=DEFAULTS["arch"],
                   help="lm: a small causal LM over tokens alone; eagle: one layer that continues the target's "
                        "features (specmesh.eagle; served by the `eagle` drafter, needs features from the verifier)")
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers, copied from the target's first (lm) or last (eagle); default 2 (lm), 1 (eagle)")
    p.add_argument("--passes", type=int, default=DEFAULTS["passes"],
                   help="eagle: training passes per batch; pass 2 reads the draft's own features, as its second "
                        "and later draft tokens do")
    p.add_argument("--first-pass-weight", type=float, default=None,
                   help="eagle, with --passes >= 2: the first pass's share of the loss, the others splitting the "
                        "rest equally (default: every pass weighs the same). The first pass trains the first "
                        "draft position, where most accepted tokens are won")
    p.add_argument("--prompt-positions", action=argparse.BooleanOptionalAction, default=False,
                   help="eagle: teach the next-token distribution at the prompt's positions as well as the "
                        "answer's (the target's features hold it there too: more teaching from the same data)")
    p.add_argument("--feature-noise", type=float, default=0.0,
                   help="eagle: add uniform noise in [-A, A] to the features the draft reads while training "
                        "(EAGLE's augmentation uses 0.1; the features' own spread is ~1.9); 0: none")
    p.add_argument("--init-from", default=None, metavar="DRAFT",
                   help="start from this draft (a folder `specmesh distill` wrote, or a shipped one's name such as "
                        "smollm2-eagle) instead of from the target's layers: its vocabulary, its layers, its "
                        "weights. With --prompts-file, fits a draft to your traffic in a fraction of a full run; "
                        "with --steps 0, only measures it on the held-out requests")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"],
                   help="optimizer steps (0 with --init-from: measure that draft, train nothing)")
    p.add_argument("--train-precision", choices=("auto", "fp32", "bf16"), default="auto",  # precision.PRECISIONS
                   help="the training forward's products: bf16 (autocast; weights, optimizer and softmaxes stay "
                        "float32; 1.54x faster steps on this project's AVX512-BF16 build machine), fp32, or auto: "
                        "bf16 where the device multiplies bfloat16 natively (AVX512-BF16 or AMX CPUs, CUDA GPUs "
                        "that support it), else fp32. The card says which ran")
    p.add_argument("--train-batch-tokens", type=int, default=DEFAULTS["train_batch_tokens"],
                   help="tokens per optimizer step")
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--kd-weight", type=float, default=DEFAULTS["kd_weight"],
                   help="weight of the soft (target top-k) loss; the rest is cross-entropy on the target's tokens")
    p.add_argument("--storage", choices=("float16", "int8"), default="float16",
                   help="weights on disk: float16, or int8 with a scale per row (half the size; the card's "
                        "acceptance is measured with the int8-rounded weights)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="optimizer steps between checkpoints")
    p.add_argument("--stop-after", choices=("data", "train"), default=None,
                   help="stop after this phase (the work folder keeps it; run again without it to finish)")


class DistillError(ValueError):
    """A bad argument or an unusable target: reported as one line, nothing written."""


def check_arguments(args) -> None:
    problems = _check_init_from(args)
    if args.layers is None:
        args.layers = 1 if args.arch == "eagle" else DEFAULTS["layers"]
    for name in ("prompts_per_category", "heldout_per_category", "max_new_tokens", "max_prompt_tokens", "batch_size",
                 "steps", "train_batch_tokens", "layers", "checkpoint_every", "passes"):
        if name == "prompts_per_category" and args.prompts_file is not None and args.prompts_per_category == 0:
            continue       # the file's requests alone
        if name == "steps" and args.init_from is not None and args.steps == 0:
            continue       # measure the draft it starts from
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
                            + (" (0 with --prompts-file)" if name == "prompts_per_category" else ""))
    if args.self_prompts_per_category < 0:
        problems.append(f"--self-prompts-per-category must be 0 or more, got {args.self_prompts_per_category}")
    if args.max_train_batches is not None and args.max_train_batches < 1:
        problems.append(f"--max-train-batches must be at least 1, got {args.max_train_batches}")
    first = args.first_pass_weight
    if first is not None and not 0.0 < first < 1.0:
        problems.append(f"--first-pass-weight must be in (0, 1), got {first}")
    if first is not None and (args.arch != "eagle" or args.passes < 2):
        problems.append("--first-pass-weight needs --arch eagle and --passes 2 or more")
    noise = args.feature_noise
    if noise < 0 or noise != noise:
        problems.append(f"--feature-noise must be 0 or more, got {noise}")
    if noise and args.arch != "eagle":
        problems.append("--feature-noise needs --arch eagle")
    if args.threads is not None and args.threads < 1:
        problems.append(f"--threads must be at least 1, got {args.threads}")
    if not 0.0 <= args.greedy_fraction <= 1.0:
        problems.append(f"--greedy-fraction must be in [0, 1], got {args.greedy_fraction}")
    if not args.temperature > 0:
        problems.append(f"--temperature must be > 0, got {args.temperature}")
    if args.vocab < 16:
        problems.append(f"--vocab must be at least 16, got {args.vocab}")
    if not args.lr > 0:
        problems.append(f"--lr must be > 0, got {args.lr}")
    if not 0.0 <= args.kd_weight <= 1.0:
        problems.append(f"--kd-weight must be in [0, 1], got {args.kd_weight}")
    if args.prompts_file is not None and not args.prompts_file.is_file():
        problems.append(f"--prompts-file {args.prompts_file} does not exist or is not a file")
    if args.out.exists() and not args.force:
        problems.append(f"--out {args.out} already exists; pass --force to replace it")
    if args.out.exists() and not args.out.is_dir():
        problems.append(f"--out {args.out} is a file")
    if problems:
        raise DistillError("; ".join(problems))


def _check_init_from(args) -> list[str]:
    """--init-from names a draft folder of the --arch asked for; its layer count becomes --layers."""
    if args.init_from is None:
        return []
    from specmesh.distilled import VOCAB_MAP_FILE
    from specmesh.drafts import resolve_draft
    from specmesh.eagle import is_eagle_draft

    folder = Path(resolve_draft(args.init_from)).expanduser()
    if not (folder / VOCAB_MAP_FILE).is_file():
        return [f"--init-from {args.init_from} is not a draft folder (no {VOCAB_MAP_FILE} in {folder})"]
    problems = []
    eagle = is_eagle_draft(str(folder))
    if eagle != (args.arch == "eagle"):
        problems.append(f"--init-from {args.init_from} is {'an EAGLE' if eagle else 'a plain'} draft; "
                        f"pass --arch {'eagle' if eagle else 'lm'}")
    try:
        config = json.loads((folder / "config.json").read_text())
        layers = int(config.get("text_config", config)["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        return problems + [f"--init-from {args.init_from}: cannot read its config.json ({error})"]
    if args.layers is not None and args.layers != layers:
        problems.append(f"--layers {args.layers} differs from --init-from {args.init_from}'s {layers}; leave it out")
    args.layers = layers
    args.init_folder = folder.resolve()
    return problems


DATA_FORMAT = 2   # 2: shards keep the target's features (last hidden state) at every position


def data_key(args, target_name: str, packed: bool = False, precision: str = "fp32") -> str:
    """Names the work folder: every argument that changes the generations. `packed`: the target generates
    with pre-packed weights, whose products round differently from stock ones (a near-tie can go the
    other way), so their data get their own folder; stock runs keep the names they always had. Dropping
    finished rows (--finished-rows drop) rounds differently too; keeping them keeps the old names. So does
    --sampler multinomial, the draws made before the choice, and `precision` "fp32" (the resolved
    --generation-precision), the products made before it."""
    fields = dict(format=DATA_FORMAT, target=target_name, seed=args.seed, p=args.prompts_per_category, h=args.heldout_per_category,
                  t=args.max_new_tokens, b=args.batch_size, g=args.greedy_fraction, temp=args.temperature)
    if packed:
        fields["kernels"] = "packed"
    if args.finished_rows == "drop":
        fields["rows"] = "drop"
    if args.sampler != "multinomial":
        fields["sampler"] = args.sampler
    if precision != "fp32":
        fields["precision"] = precision
    if args.max_prompt_tokens != DEFAULTS["max_prompt_tokens"]:
        fields["prompt_tokens"] = args.max_prompt_tokens
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(target_name).name)
    return f"{safe}-seed{args.seed}-{digest}"


def main(args, argv: list[str] | None = None) -> int:
    import signal

    # A run stopped with SIGTERM (kill, a job scheduler) unwinds like Ctrl-C, so the phase it was in
    # still adds its time to timings.json and the card's wall time counts it after the resume.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return _run(args, argv)
    except DistillError as error:
        print(f"specmesh distill: error: {error}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args, argv) -> int:
    import torch

    from specmesh.models import ModelLoadError, cache_dir, load_model

    check_arguments(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        target = load_model(args.target, device=device)
    except ModelLoadError as error:
        raise DistillError(str(error)) from error
    if args.self_prompts_per_category and target.tokenizer.chat_template is None:
        raise DistillError(f"--self-prompts-per-category needs a target with a chat template (the target writes a "
                           f"user's request into it); {target.info.name} has none")
    args.prompts_source = _read_prompts_file(args, target.tokenizer.chat_template is not None)
    _check_start_fits(args, target.info)
    from specmesh.fast_linear import available, bf16_available, packed_while

    from distill.precision import resolve_precision

    torch.manual_seed(args.seed)
    packed = args.generation_kernels == "packed" and available(target.model)
    generation_precision = resolve_precision(args.generation_precision, device)
    if generation_precision == "bf16" and packed and not bf16_available():
        raise DistillError("--generation-precision bf16: this CPU's oneDNN has no bfloat16 products for the "
                           "pre-packed weights; add --generation-kernels stock (torch's own bfloat16 products) or use fp32")
    work = args.work_dir or cache_dir() / "distill" / data_key(args, target.info.name, packed, generation_precision)
    work.mkdir(parents=True, exist_ok=True)
    log.info("work folder %s (run the same command again to resume)", work)
    timings = _Timings(work / "timings.json")

    from distill import phases

    # Packed only while generating: training copies the target's last layer into the draft, and a copied
    # packed layer would keep serving its stale packed weights once training changed them.
    with timings.phase("data"), (packed_while(target.model) if packed else contextlib.nullcontext()):
        data = phases.make_data(args, target, work, generation_precision)
    if args.stop_after == "data":
        return 0
    # Training and evaluation time is kept per training configuration: runs with other steps or
    # sizes over the same data share the work folder, and a card reports only its own run.
    precision = resolve_precision(args.train_precision, device)
    run_key = phases.train_key(args, precision)
    with timings.phase(f"train {run_key}"):
        model, vocab_map, facts = phases.train(args, target, data, work, device, precision)
    if args.stop_after == "train":
        return 0
    with timings.phase(f"evaluate {run_key}"):
        report = phases.evaluate(args, target, model, vocab_map, data, device)
    facts.update(device=device, threads=torch.get_num_threads(), generation_kernels="packed" if packed else "stock",
                 generation_precision=generation_precision)
    if data.prompts_file:
        facts["prompts_file"] = data.prompts_file
    timings.keep("data", f"train {run_key}", f"evaluate {run_key}")
    _write_output(args, lambda folder: phases.save(args, argv, target, model, vocab_map, facts, report, timings, data,
                                                   folder))
    log.info("wrote %s", args.out)
    return 0


def _read_prompts_file(args, chat_template: bool):
    """--prompts-file, read and split before anything is generated: a bad line stops the run at once."""
    if args.prompts_file is None:
        return None
    from distill import prompts_file

    try:
        return prompts_file.load_for_training(args.prompts_file, args.heldout_per_category, args.seed, chat_template)
    except prompts_file.PromptsFileError as error:
        raise DistillError(str(error)) from None


def _check_start_fits(args, target_info) -> None:
    """--init-from made for another target stops the run before the data phase, naming both."""
    if args.init_from is None:
        return
    from specmesh.distilled import VocabMap, check_fits
    from specmesh.models import ModelLoadError, VocabularyMismatch

    try:
        check_fits(VocabMap.read(args.init_folder), str(args.init_folder), target_info)
    except (ModelLoadError, VocabularyMismatch) as error:
        raise DistillError(f"--init-from {args.init_from}: {error}") from None


def _write_output(args, save) -> None:
    """Write into a temp sibling and rename it to --out: never a half-written folder."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.tmp-", dir=args.out.parent))
    try:
        save(tmp)
        os.chmod(tmp, 0o755)
        if args.out.exists():
            shutil.rmtree(args.out)
        os.rename(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class _Timings:
    """Wall time per phase, summed over resumed runs (kept in the work folder)."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def phase(self, name: str):
        timings = self

        class _Phase:
            def __enter__(self):
                self.started = time.monotonic()

            def __exit__(self, *exc):
                timings.add(name, time.monotonic() - self.started)

        return _Phase()

    def add(self, name: str, seconds: float) -> None:
        # Re-read first: two runs over the same data (an A/B of training settings) share the file,
        # and writing back what this run read at start would drop the other run's time.
        on_disk = json.loads(self.path.read_text()) if self.path.exists() else {}
        on_disk[name] = on_disk.get(name, 0.0) + seconds
        # Whole or not at all: two runs finishing a phase at once wrote over each other's bytes, and both
        # then failed to read the file back (seen with two training runs in step).
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(on_disk, indent=1))
        tmp.replace(self.path)
        self.seconds[name] = on_disk[name]

    def keep(self, *names: str) -> None:
        """Report only these phases (this run's) from now on."""
        self.seconds = {name: self.seconds.get(name, 0.0) for name in names}

    @property
    def total(self) -> float:
        return sum(self.seconds.values())
