"""`specmesh distill` and distilled drafts: data, training, the folder format,
loading (and refusing) it, and serving it through the three real services.

Everything runs on tiny random models (seconds); the shipped draft for the
default target is covered by tests/test_distilled_default.py.
"""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

import pytest
import torch

from distill.prompts import CATEGORIES, build_prompts
from distill.run import DEFAULTS
from specmesh_cli import cli
from specmesh.client import Client
from specmesh.distilled import VOCAB_MAP_FILE, is_distilled_draft, load_draft
from specmesh_cli.launcher import Cluster
from specmesh.models import ModelLoadError, VocabularyMismatch, load_model, load_tokenizer
from specmesh_cli.ports import free_port
from specmesh.sampling import SamplingParams
from specmesh.spec_bench import QUESTIONS as BENCH

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

if not BENCH.exists():      # a clone outside the workspace (CI's) has no ../shared beside it
    BENCH = Path("/work/shared/bench/spec_bench_questions.jsonl")

TINY_ARGS = ["--prompts-per-category", "1", "--heldout-per-category", "1", "--max-new-tokens", "12",
             "--batch-size", "8", "--vocab", "24", "--layers", "1", "--steps", "8", "--train-batch-tokens", "512",
             "--checkpoint-every", "4", "--seed", "3", "--threads", "1",
             # "auto" is bf16 on a CPU with native bf16 products: pinned, so a test's data are the same on any CPU.
             "--generation-precision", "fp32"]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, tiny_models):
    """One tiny distill run shared by the tests below: (output folder, work folder)."""
    root = tmp_path_factory.mktemp("distill")
    out, work = root / "draft", root / "work"
    code = cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir", str(work),
                     *TINY_ARGS])
    assert code == 0
    return out, work


def test_distill_writes_a_loadable_draft_folder(distilled, tiny_models):
    out, work = distilled
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", VOCAB_MAP_FILE, "README.md", "distill.json"} <= names
    assert not list(out.parent.glob(".draft.tmp-*")), "the temp folder was left behind"
    target = load_model(str(tiny_models["target"]))
    draft = load_draft(str(out), target=target.info)
    # The draft speaks for the target's vocabulary: that is what the orchestrator compares.
    assert draft.info.vocab_fingerprint == target.info.vocab_fingerprint
    assert draft.info.vocab_size == target.info.vocab_size
    assert draft.model.get_output_embeddings().weight.shape[0] == 24
    assert len(draft.vocab_map.draft_to_target) == 23          # plus the input-only "other" bucket
    card = (out / "README.md").read_text()
    assert "--seed 3" in card and "wall time" in card and "| overall |" in card
    facts = json.loads((out / "distill.json").read_text())
    assert facts["steps"] == 8 and "overall" in facts["acceptance"]


def test_distill_is_deterministic_and_resumes(distilled, tiny_models, tmp_path):
    """Same seed, fresh work folder -> the same weights; a second run over the old work folder
    (every shard and checkpoint already there) resumes instead of starting again."""
    out, work = distilled
    again = tmp_path / "again"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(again),
                     "--work-dir", str(tmp_path / "work"), *TINY_ARGS]) == 0
    from safetensors.torch import load_file

    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)

    checkpoints = list(work.glob("train-*/checkpoint.pt"))
    assert len(checkpoints) == 1 and torch.load(checkpoints[0], weights_only=False)["step"] == 8
    before = {p: p.stat().st_mtime_ns for p in work.rglob("*.pt")}
    resumed = tmp_path / "resumed"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(resumed),
                     "--work-dir", str(work), *TINY_ARGS]) == 0
    assert {p: p.stat().st_mtime_ns for p in work.rglob("*.pt")} == before, "a resumed run redid finished work"
    assert load_file(resumed / "model.safetensors").keys() == first.keys()


def test_loading_refuses_a_map_for_another_target(distilled, tiny_models):
    out, _ = distilled
    other = load_model(str(tiny_models["other_vocab"]))
    with pytest.raises(VocabularyMismatch) as error:
        load_draft(str(out), target=other.info)
    message = str(error.value)
    assert "distilled for target" in message and str(tiny_models["target"].resolve()) in message
    assert other.info.name in message and other.info.vocab_fingerprint in message


def test_loading_refuses_a_broken_map(distilled, tmp_path):
    out, _ = distilled
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in out.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    raw = json.loads((broken / VOCAB_MAP_FILE).read_text())
    raw["draft_to_target"][0] = raw["target_vocab_size"]           # an id the target does not have
    (broken / VOCAB_MAP_FILE).write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="distinct target ids"):
        load_draft(str(broken))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--greedy-fraction", "1.5"], "--greedy-fraction must be in"),
    (["--vocab", "3"], "--vocab must be at least 16"),
    (["--target", "/no/such/model"], "does not exist"),
    (["--arch", "eagle", "--passes", "3", "--first-pass-weight", "1.5"], "--first-pass-weight must be in (0, 1)"),
    (["--arch", "eagle", "--passes", "1", "--first-pass-weight", "0.5"], "needs --arch eagle and --passes 2"),
    (["--arch", "eagle", "--feature-noise", "-0.1"], "--feature-noise must be 0 or more"),
    (["--feature-noise", "0.1"], "--feature-noise needs --arch eagle"),
    (["--self-prompts-per-category", "-1"], "--self-prompts-per-category must be 0 or more"),
    (["--prompts-file", "/no/such/requests.jsonl"], "--prompts-file /no/such/requests.jsonl does not exist"),
    (["--prompts-per-category", "0"], "--prompts-per-category must be at least 1, got 0 (0 with --prompts-file)"),
    (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be at least 1"),
])
def test_bad_arguments_give_a_clear_message_and_no_output(tmp_path, tiny_models, capsys, argv, message):
    out = tmp_path / "out"
    args = ["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir",
            str(tmp_path / "work"), *argv]
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_existing_output_is_kept_without_force(tmp_path, tiny_models, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_served_through_the_three_services(distilled, tiny_models, redis_url, tmp_path):
    """The distilled draft serves as the `model` drafter and inside `hybrid`: greedy output equals
    target-only decoding."""
    out, _ = distilled
    with Cluster(model=str(tiny_models["target"]), draft_model=str(out), port=free_port(), redis_url=redis_url,
                 log_dir=tmp_path / "logs", startup_timeout_s=900) as cluster, Client(cluster.address) as client:
        for prompt in ("the cat sat on the mat", "hello world, hello world, hello"):
            baseline = client.generate(prompt, max_new_tokens=24, k=0)
            for drafter in ("model", "hybrid"):
                drafted = client.generate(prompt, max_new_tokens=24, k=4, drafter=drafter)
                assert drafted.token_ids == baseline.token_ids, drafter
                assert drafted.drafter == drafter


def test_proposals_live_on_the_subset(distilled, tiny_models):
    from draft_service.drafters.model import DistilledDrafter
    from draft_service.engine import DraftEngine
    from specmesh.config import DraftConfig

    out, _ = distilled
    engine = DraftEngine.from_config(DraftConfig(draft_model=str(out)))
    drafter = engine.drafters["model"]
    assert isinstance(drafter, DistilledDrafter)
    subset = set(drafter.draft_to_target.tolist())
    tokenizer, _ = load_tokenizer(str(tiny_models["target"]))
    prompt = tokenizer("some words here").input_ids
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.8)):
        proposals, _ = engine.propose("s", 0, prompt, 4, "model", params, seed=7, top_n=8)
        assert len(proposals) == 4
        for p in proposals:
            assert p.token_id in subset and set(p.q_ids.tolist()) <= subset
            assert p.token_id in p.q_ids.tolist() and abs(float(p.q_probs.sum()) - 1) < 1e-5
        if params.greedy:
            assert all(len(p.q_ids) == 1 for p in proposals)


def test_a_plain_draft_folder_still_loads(tiny_models):
    from draft_service.drafters.model import DistilledDrafter, ModelDrafter
    from specmesh.config import DraftConfig

    assert not is_distilled_draft(str(tiny_models["draft"]))
    drafter = ModelDrafter.from_config(DraftConfig(draft_model=str(tiny_models["draft"])))
    assert type(drafter) is ModelDrafter and not isinstance(drafter, DistilledDrafter)


# --------------------------------------------------------------------------- the data stay off the benchmark


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(words: list[str], n: int) -> set[tuple[str, ...]]:
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def test_no_training_prompt_overlaps_a_bench_question():
    """No prompt the default run uses (training or held-out, several seeds) is, contains or is contained
    in a Spec-Bench question turn, or shares a run of 8 words with one."""
    turns = [t for line in BENCH.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    bench_norm = [" ".join(_words(t)) for t in turns]
    bench_grams = set().union(*(_ngrams(_words(t), 8) for t in turns))
    n = DEFAULTS["prompts_per_category"] + DEFAULTS["heldout_per_category"]
    for seed in (0, 1, 2):
        prompts = build_prompts(n, seed)
        assert {p.category for p in prompts} == set(CATEGORIES)
        for prompt in prompts:
            mine = " ".join(_words(prompt.text))
            assert not any(mine == b or mine in b or (b and b in mine) for b in bench_norm), prompt.text
            shared = _ngrams(_words(prompt.text), 8) & bench_grams
            assert not shared, f"{prompt.text!r} shares {sorted(shared)[:3]} with a bench question"


def test_int8_storage_round_trips(distilled, tiny_models, tmp_path):
    from specmesh.distilled import INT8_FILE, save_draft

    out, _ = distilled
    draft = load_draft(str(out))
    small = tmp_path / "int8"
    save_draft(small, draft.model, draft.vocab_map, card="# int8\n", storage="int8")
    assert (small / INT8_FILE).is_file() and not (small / "model.safetensors").exists()
    again = load_draft(str(small))
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.inference_mode():
        a, b = draft.model(input_ids=ids).logits, again.model(input_ids=ids).logits
    assert torch.allclose(a, b, atol=0.05 * float(a.abs().max())), float((a - b).abs().max())


# --------------------------------------------------------------------------- requests the target writes itself


def test_self_written_requests_extend_the_template_data(distilled, tiny_models, tmp_path):
    """--self-prompts-per-category: the target writes requests into its own chat template, opened with its
    category's first words; their answers join training in a folder of their own, so the template answers
    already in the work folder are reused, and a second run reads both back instead of sampling again."""
    import shutil

    from distill.self_prompts import OPENINGS

    out, work = distilled
    copy = tmp_path / "work"
    shutil.copytree(work, copy)
    template_shards = {p: p.stat().st_mtime_ns for p in (copy / "data").rglob("*.pt")}
    argv = ["distill", "--target", str(tiny_models["target"]), "--out", str(tmp_path / "out"), "--work-dir",
            str(copy), *TINY_ARGS, "--self-prompts-per-category", "3"]
    assert cli.main(argv) == 0
    assert {p: p.stat().st_mtime_ns for p in template_shards} == template_shards, "template answers were redone"

    written = json.loads((copy / "data" / "self-3" / "prompts.json").read_text())
    by_category = {c: [p["text"] for p in written if p["category"] == c] for c in CATEGORIES}
    assert all(1 <= len(texts) <= 3 for texts in by_category.values()), {c: len(t) for c, t in by_category.items()}
    assert len({p["text"] for p in written}) == len(written)
    for p in written:
        assert any(p["text"].startswith(o) for o in OPENINGS[p["category"]]), p
        assert len(p["text"].split()) >= 3

    base = json.loads((out / "distill.json").read_text())["facts"]["train_examples"]
    facts = json.loads((tmp_path / "out" / "distill.json").read_text())["facts"]
    assert facts["train_examples"] == base + len(written)
    assert "--self-prompts-per-category 3" in (tmp_path / "out" / "README.md").read_text()
    assert any("-self3" in p.name for p in copy.glob("train-*")), "the run trained into the template-only folder"

    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file() and p.suffix in (".pt", ".json")
              and p.name != "timings.json"}
    assert cli.main([*argv[:4], str(tmp_path / "again"), *argv[5:]]) == 0
    after = {p: p.stat().st_mtime_ns for p in before}
    assert after == before, "a resumed run wrote its requests or answers again"


def test_the_user_turn_prefix_is_the_template_before_the_content(tiny_models):
    from distill.self_prompts import user_turn_prefix

    tokenizer, _ = load_tokenizer(str(tiny_models["target"]))
    assert user_turn_prefix(tokenizer) == "<s>user: "
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        user_turn_prefix(tokenizer)


def test_self_written_requests_need_a_chat_template(tiny_models, tmp_path, capsys):
    """A target without a chat template has no user turn to write into: one clear line, exit 2, nothing written."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(tiny_models["target"], bare)
    (bare / "chat_template.jinja").unlink()
    out = tmp_path / "out"
    assert cli.main(["distill", "--target", str(bare), "--out", str(out), "--work-dir", str(tmp_path / "work"),
                     *TINY_ARGS, "--self-prompts-per-category", "2"]) == 2
    assert "--self-prompts-per-category needs a target with a chat template" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "work" / "data").exists()


def test_a_written_request_near_a_bench_question_is_dropped(tmp_path):
    """The bench filter drops a request that is a benchmark turn, contains one, or shares eight words
    running with one, and keeps the rest; with no benchmark file it keeps everything."""
    from distill.self_prompts import BenchFilter

    questions = tmp_path / "q.jsonl"
    turn = "Describe the life cycle of a monarch butterfly from egg to adult in five short steps."
    questions.write_text(json.dumps({"turns": [turn, "Now do it as a poem."]}) + "\n")
    keep = BenchFilter(questions)
    assert not keep(turn)
    assert not keep(turn.upper() + " Thank you!")
    assert not keep("Please tell me: the life cycle of a monarch butterfly from egg to adult, briefly")
    assert not keep("now do it as a poem")
    assert keep("Describe the life cycle of a frog.")
    assert keep("Write a poem about a monarch butterfly.")
    assert BenchFilter(tmp_path / "absent.jsonl")(turn)


def test_the_real_bench_file_is_read_by_the_filter():
    from distill.self_prompts import BenchFilter

    keep = BenchFilter(BENCH)
    first = json.loads(BENCH.read_text().splitlines()[0])["turns"][0]
    assert keep.turns and not keep(first)


# --------------------------------------------------------------------------- EAGLE-style drafts (--arch eagle)


@pytest.fixture(scope="module")
def eagle_distilled(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("eagle")
    out, work = root / "eagle", root / "work"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir", str(work),
                     *TINY_ARGS, "--arch", "eagle"]) == 0
    return out, work


def test_distill_eagle_writes_a_folder_that_loads_and_continues_features(eagle_distilled, tiny_models, tmp_path):
    """The folder holds the draft LM, its map and `fc`; loaded, it reproduces the trained model's outputs
    (same seed, fresh work folder -> the same weights), and it refuses a target it was not made for."""
    from safetensors.torch import load_file

    from specmesh.eagle import EAGLE_FILE, EagleDraft, is_eagle_draft, load_eagle

    out, work = eagle_distilled
    assert is_eagle_draft(str(out)) and (out / EAGLE_FILE).is_file()
    card = (out / "README.md").read_text()
    assert "EAGLE-style" in card
    # the served draft tree's acceptance is measured too (a step commits at least one token)
    overall = next(line for line in card.splitlines() if line.startswith("| overall |")).split("|")
    assert "committed/step tree k=4" in card and float(overall[5]) >= 1.0 and float(overall[4]) >= 1.0
    # ... and it is the tree the draft tier serves by default, as the card says
    from distill.evaluate import SERVED_TREE
    from specmesh.config import DraftConfig

    defaults = DraftConfig()
    assert SERVED_TREE == (4, min(4, defaults.tree_depth), defaults.tree_branch)
    assert f"(depth {SERVED_TREE[1]}, {SERVED_TREE[2]} children per expanded node" in card
    assert json.loads((out / "distill.json").read_text())["arch"] == "eagle"
    target = load_model(str(tiny_models["target"]))
    draft = load_eagle(str(out), target=target.info)
    assert isinstance(draft.model, EagleDraft)
    hidden = draft.model.hidden_size
    assert draft.model.fc.weight.shape == (hidden, 2 * hidden)
    # The head is the target's own output rows for the subset (frozen in training).
    rows = target.model.get_output_embeddings().weight[draft.draft_to_target]
    assert torch.allclose(draft.model.lm.lm_head.weight[:-1], rows, atol=1e-2)
    # The shards carry the target's features: one row per position but the last.
    shard = torch.load(next((work / "data" / "train").glob("shard-*.pt")), weights_only=False)[0]
    assert shard["features"].shape == (len(shard["prompt_ids"]) + len(shard["response_ids"]) - 1, hidden)

    again = tmp_path / "again"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(again),
                     "--work-dir", str(tmp_path / "work"), *TINY_ARGS, "--arch", "eagle"]) == 0
    for name in (EAGLE_FILE, "model.safetensors"):
        first, second = load_file(out / name), load_file(again / name)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    other = load_model(str(tiny_models["other_vocab"]))
    with pytest.raises(VocabularyMismatch):
        load_eagle(str(out), target=other.info)


def test_eagle_features_match_the_targets_last_hidden_state(eagle_distilled, tiny_models):
    """What the data keep as features is what the target's head reads: its logits come back exactly."""
    out, work = eagle_distilled
    target = load_model(str(tiny_models["target"]))
    example = torch.load(next((work / "data" / "train").glob("shard-*.pt")), weights_only=False)[0]
    ids = torch.tensor([list(example["prompt_ids"]) + list(example["response_ids"])])
    with torch.inference_mode():
        hidden = target.model.model(input_ids=ids[:, :-1]).last_hidden_state[0]
    assert torch.allclose(example["features"].float(), hidden, atol=2e-2 * float(hidden.abs().max()))


def test_eagle_prompt_positions_teach_the_prompt_too(eagle_distilled, tiny_models, tmp_path):
    """--prompt-positions: the token loss covers every position of prompt and answer (the same loss as
    answer-only training on a batch whose whole sequence is answer), trains a run of its own over the
    same data, and the card says so."""
    from safetensors.torch import load_file

    from distill import eagle_train
    from distill.generate import load_examples
    from specmesh.eagle import EAGLE_FILE, load_eagle

    out, work = eagle_distilled
    target = load_model(str(tiny_models["target"]))
    draft = load_eagle(str(out), target=target.info)
    raw = load_examples(sorted((work / "data" / "train").glob("shard-*.pt")))
    batch = eagle_train.collate(eagle_train.make_examples(raw, draft.target_to_draft, max_len=64), "cpu")
    assert not torch.equal(batch["answer"], batch["attention_mask"].bool())     # prompts are there to teach
    head = draft.model.lm.lm_head.weight[:-1].detach().float()
    with torch.no_grad():
        everywhere, _ = eagle_train.eagle_loss(1, head, prompt_positions=True)(draft.model, batch)
        answers, _ = eagle_train.eagle_loss(1, head)(draft.model, batch)
        as_if_all_answer, _ = eagle_train.eagle_loss(1, head)(draft.model,
                                                              dict(batch, answer=batch["attention_mask"].bool()))
    assert torch.equal(everywhere, as_if_all_answer) and not torch.equal(everywhere, answers)

    pp = tmp_path / "pp"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(pp), "--work-dir", str(work),
                     *TINY_ARGS, "--arch", "eagle", "--prompt-positions"]) == 0
    assert any(p.name.endswith("-pp") for p in work.iterdir())          # its own run over the same data
    assert "every position, prompt and answer" in (pp / "README.md").read_text()
    assert not torch.equal(load_file(pp / EAGLE_FILE)["fc.weight"], load_file(out / EAGLE_FILE)["fc.weight"])


def test_first_pass_weight_weighs_the_passes(eagle_distilled, tiny_models):
    """--first-pass-weight W: the loss is W x pass 1 + the other passes sharing 1 - W; without it, the
    passes' mean, computed as before (the shipped drafts reproduce bit for bit)."""
    from distill import eagle_train
    from distill.generate import load_examples
    from specmesh.eagle import load_eagle

    assert eagle_train.pass_weights(3, 0.5) == [0.5, 0.25, 0.25]
    assert eagle_train.pass_weights(2) is None and eagle_train.pass_weights(1, 0.5) is None
    out, work = eagle_distilled
    target = load_model(str(tiny_models["target"]))
    draft = load_eagle(str(out), target=target.info)
    raw = load_examples(sorted((work / "data" / "train").glob("shard-*.pt")))
    batch = eagle_train.collate(eagle_train.make_examples(raw, draft.target_to_draft, max_len=64), "cpu")
    head = draft.model.lm.lm_head.weight[:-1].detach().float()
    with torch.no_grad():
        equal, stats = eagle_train.eagle_loss(3, head)(draft.model, batch)
        third, _ = eagle_train.eagle_loss(3, head, first_pass_weight=1 / 3)(draft.model, batch)
        half, _ = eagle_train.eagle_loss(3, head, first_pass_weight=0.5)(draft.model, batch)
    terms = [eagle_train.REG_WEIGHT * stats[f"reg{p}"] + eagle_train.CE_WEIGHT * stats[f"ce{p}"] for p in range(3)]
    assert float(third) == pytest.approx(float(equal), rel=1e-5)
    assert float(half) == pytest.approx(0.5 * terms[0] + 0.25 * (terms[1] + terms[2]), rel=1e-4)
    assert float(half) != pytest.approx(float(equal), rel=1e-4)   # the tiny draft's passes differ


def test_feature_noise_is_drawn_from_seed_and_step(eagle_distilled, tiny_models):
    """--feature-noise A: the passes read their features with noise in [-A, A], drawn from (seed, step) so
    that a resumed run draws what an uninterrupted one did; the same step gives the same loss, another
    step or seed another, and no noise is the loss computed as before."""
    from distill import eagle_train
    from distill.generate import load_examples
    from specmesh.eagle import load_eagle

    out, work = eagle_distilled
    draft = load_eagle(str(out), target=load_model(str(tiny_models["target"])).info)
    raw = load_examples(sorted((work / "data" / "train").glob("shard-*.pt")))
    batch = eagle_train.collate(eagle_train.make_examples(raw, draft.target_to_draft, max_len=64), "cpu")
    head = draft.model.lm.lm_head.weight[:-1].detach().float()

    def loss(noise, seed, step):
        with torch.no_grad():
            return float(eagle_train.eagle_loss(2, head, feature_noise=noise, seed=seed)(
                draft.model, {**batch, "step": step})[0])

    plain = float(eagle_train.eagle_loss(2, head)(draft.model, batch)[0])
    assert loss(0.0, 0, 3) == plain
    assert loss(0.5, 0, 3) == loss(0.5, 0, 3) != plain
    assert loss(0.5, 0, 4) != loss(0.5, 0, 3) != loss(0.5, 1, 3)


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_draft_head_tokens_cuts_the_head_to_the_most_frequent(kind, distilled, eagle_distilled):
    """DraftConfig.draft_head_tokens = N: a distilled or EAGLE draft's head keeps its first N rows
    (the N most frequent tokens) and the 'other' row; its logits there are the uncut head's, and
    every proposal (token and q) stays among those N tokens."""
    from specmesh.config import DraftConfig
    from specmesh.sampling import SamplingParams
    from draft_service.drafters.eagle import EagleDrafter
    from draft_service.drafters.model import ModelDrafter

    folder = str((distilled if kind == "model" else eagle_distilled)[0])
    config = dict(draft_model=folder) if kind == "model" else dict(eagle_model=folder)
    drafter_cls = ModelDrafter if kind == "model" else EagleDrafter
    whole = drafter_cls.from_config(DraftConfig(**config, draft_head_tokens=0, batch_invariant=False,
                                                linear_kernels="stock"))
    cut = drafter_cls.from_config(DraftConfig(**config, draft_head_tokens=6, batch_invariant=False,
                                              linear_kernels="stock"))
    lm = (lambda d: d.model) if kind == "model" else (lambda d: d.model.lm)
    w_whole, w_cut = lm(whole).get_output_embeddings().weight, lm(cut).get_output_embeddings().weight
    assert w_whole.shape[0] == 24 and w_cut.shape[0] == 7
    assert torch.equal(w_cut[:6], w_whole[:6]) and torch.equal(w_cut[-1], w_whole[-1])
    allowed = set(whole.draft_to_target[:6].tolist())
    hidden = getattr(cut, "feature_dim", None)
    for seed in range(4):
        state = cut.new_state(f"s{seed}")
        prompt = [int(t) for t in whole.draft_to_target[[3, 9, 1, 15, 4]]]
        if hidden:
            state.sync(0, prompt, None, torch.randn(len(prompt), hidden))
        else:
            state.sync(0, prompt)
        for p in cut.propose(state, 3, SamplingParams(temperature=1.0), seed, 8):
            assert p.token_id in allowed and set(p.q_ids.tolist()) <= allowed


# --------------------------------------------------------------------------- the target's generations


def test_generations_equal_greedy_decoding_without_a_cache(tiny_models):
    """The data phase's cached, batched, left-padded decoding gives what recomputing the whole sequence
    at every step gives: a cache passed under a name this transformers ignores would fail here (the
    model would see one token a step), as would padding that leaks into attention."""
    from distill.generate import GenerationPlan, generate_batch

    target = load_model(str(tiny_models["target"]))
    prompts = [[5, 9, 13, 17, 21, 25, 29], [7, 8], [30, 31, 32, 33]]
    batch = [dict(prompt_ids=p, temperature=0.0, index=i, category="qa") for i, p in enumerate(prompts)]
    eos = [1_000_000]       # none: every row runs the full length
    rows = generate_batch(target.model, batch, GenerationPlan(max_new_tokens=6), eos, 0, torch.Generator())
    for prompt, row in zip(prompts, rows):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(6):
                ids.append(int(target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert row["response_ids"] == ids[len(prompt):]
        assert row["features"].shape[0] == len(prompt) + 6 - 1


def test_packed_generation_gives_the_stock_answers_and_leaves_the_target_as_it_was(tiny_models):
    """The data phase generates with pre-packed weights (`--generation-kernels packed`): the same greedy
    answers and features to float rounding, and afterwards the target's own nn.Linear modules over the
    very same Parameters (training copies its last layer; a packed copy would serve stale weights)."""
    from distill.generate import GenerationPlan, generate_batch
    from specmesh.fast_linear import PackedLinear, packed_while

    target = load_model(str(tiny_models["target"]))
    model = target.model
    params = {name: p for name, p in model.named_parameters()}
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    prompts = [[5, 9, 13, 17, 21, 25, 29], [7, 8], [30, 31, 32, 33]]
    batch = [dict(prompt_ids=p, temperature=0.0, index=i, category="qa") for i, p in enumerate(prompts)]
    plan, eos = GenerationPlan(max_new_tokens=8), [1_000_000]
    stock = generate_batch(model, batch, plan, eos, 0, torch.Generator())
    with packed_while(model) as count:
        assert count == linears > 0
        assert sum(isinstance(m, PackedLinear) for m in model.modules()) == linears
        packed = generate_batch(model, batch, plan, eos, 0, torch.Generator())
    for a, b in zip(stock, packed):
        assert a["response_ids"] == b["response_ids"]
        torch.testing.assert_close(a["features"].float(), b["features"].float(), atol=2e-3, rtol=2e-3)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert sum(type(m) is torch.nn.Linear for m in model.modules()) == linears
    assert all(p is params[name] for name, p in model.named_parameters())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight


def test_packed_generations_get_their_own_work_folder():
    """Packed products round differently from stock ones, so their data never extend a stock folder;
    a stock run keeps the folder name it had before the option existed."""
    import argparse

    from distill.run import add_arguments, data_key

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "x"])
    assert args.generation_kernels == "packed"
    assert data_key(args, "t", packed=True) != data_key(args, "t", packed=False)
    assert data_key(args, "t", packed=False) == data_key(args, "t")


@pytest.mark.parametrize("sampler", ["inverse-cdf", "multinomial"])
def test_rows_dropped_when_finished_leave_every_answer_as_it_was(tiny_models, monkeypatch, sampler):
    """A batch drops its finished rows from the forward and the cache (`--finished-rows drop`): every row,
    greedy or sampled, gets the tokens it gets when all rows run to the end, and the same features and
    log-probs to float rounding (a smaller batch rounds some positions in the last bit)."""
    from transformers import DynamicCache

    from distill.generate import GenerationPlan, generate_batch

    target = load_model(str(tiny_models["target"]))
    prompts = [[5 + i, 9, 13 + 2 * i, 17][: 2 + i % 3] for i in range(8)]
    drops = []
    original = DynamicCache.batch_select_indices
    monkeypatch.setattr(DynamicCache, "batch_select_indices",
                        lambda self, indices: (drops.append(len(indices)), original(self, indices))[1])
    for temperature in (0.0, 0.8):
        batch = [dict(prompt_ids=p, temperature=temperature, index=i, category="qa") for i, p in enumerate(prompts)]
        plan = GenerationPlan(max_new_tokens=12, temperature=temperature, sampler=sampler)
        # End-of-sequence ids the rows reach at different steps: tokens some rows produce early and others never.
        full = generate_batch(target.model, batch, GenerationPlan(max_new_tokens=12, drop_finished_rows=False),
                              [1_000_000], 0, torch.Generator().manual_seed(4))
        eos = sorted({row["response_ids"][2 + r % 5] for r, row in enumerate(full[:4])})
        kept = generate_batch(target.model, batch, GenerationPlan(max_new_tokens=12, temperature=temperature,
                                                                  drop_finished_rows=False, sampler=sampler),
                              eos, 0, torch.Generator().manual_seed(4))
        drops.clear()
        dropped = generate_batch(target.model, batch, plan, eos, 0, torch.Generator().manual_seed(4))
        lengths = [len(row["response_ids"]) for row in kept]
        assert min(lengths) < 12 and max(lengths) == 12, lengths      # rows end at different steps
        assert drops and min(drops) < len(batch)                     # so the batch did shrink
        for a, b in zip(kept, dropped):
            assert a["response_ids"] == b["response_ids"]
            assert a["features"].shape == b["features"].shape
            torch.testing.assert_close(a["features"].float(), b["features"].float(), atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(a["top_logp"].float(), b["top_logp"].float(), atol=2e-2, rtol=2e-3)


def test_kept_rows_find_the_work_folders_made_before_the_option():
    """`--finished-rows keep` names the work folder as it was named before rows could be dropped (the
    shipped EAGLE draft's data are in that folder, so its card's command resumes there); `drop` gets its own."""
    import argparse

    from distill.run import add_arguments, data_key

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    shipped = ("--arch eagle --out x --seed 0 --threads 2 --prompts-per-category 400 --self-prompts-per-category 150 "
               "--steps 1500 --lr 3e-3 --passes 2 --train-batch-tokens 2048 --storage int8").split()
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert parser.parse_args(shipped).finished_rows == "drop"
    old = ["--finished-rows", "keep", "--sampler", "multinomial"]
    assert data_key(parser.parse_args(shipped + old), name, packed=True) == f"{name}-seed0-712e44eb25"
    assert data_key(parser.parse_args(shipped + old[2:]), name, packed=True) != f"{name}-seed0-712e44eb25"


def test_each_sampler_gets_its_own_work_folder():
    """Draws made with torch.multinomial (every work folder before --sampler) keep their folder's name;
    the default inverse-CDF draws, being other draws, get their own."""
    import argparse

    from distill.run import DATA_FORMAT, add_arguments, data_key

    from distill.generate import SAMPLERS
    from distill.precision import PRECISIONS

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # run.py names the choices without importing torch; they are the modules' own.
    choices = {a.dest: tuple(a.choices) for a in parser._actions
               if a.dest in ("sampler", "train_precision", "generation_precision")}
    assert choices == {"sampler": SAMPLERS, "train_precision": PRECISIONS, "generation_precision": PRECISIONS}
    base = ["--out", "x"]
    assert parser.parse_args(base).sampler == "inverse-cdf"
    keys = {s: data_key(parser.parse_args(base + ["--finished-rows", "keep", "--sampler", s]), "t")
            for s in ("inverse-cdf", "multinomial")}
    assert keys["multinomial"] != keys["inverse-cdf"]
    # The names made before the option: no "sampler" field hashed in.
    import hashlib

    fields = dict(format=DATA_FORMAT, target="t", seed=0,
                  p=DEFAULTS["prompts_per_category"], h=DEFAULTS["heldout_per_category"],
                  t=DEFAULTS["max_new_tokens"], b=DEFAULTS["batch_size"], g=DEFAULTS["greedy_fraction"],
                  temp=DEFAULTS["temperature"])
    assert keys["multinomial"] == "t-seed0-" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


@pytest.mark.parametrize("sampler", ["inverse-cdf", "multinomial"])
def test_a_sampler_draws_each_token_as_often_as_its_probability(sampler):
    """Both samplers draw from the probabilities they are given: a token's share over many draws is its
    probability, a token of probability 0 is never drawn (nor the last one, 0 too), and a row's draws do not
    depend on which other rows are still in the batch."""
    from distill.generate import draw_tokens

    p = torch.tensor([0.5, 0.0, 0.2, 0.05, 0.25, 0.0])
    n, steps = 64, 200
    probs = p.repeat(n, 1)                                                       # [B, V]
    generator = torch.Generator().manual_seed(0)
    draws = torch.cat([draw_tokens(probs, torch.arange(n), n, generator, sampler) for _ in range(steps)])
    share = torch.bincount(draws, minlength=len(p)).float() / len(draws)
    # 12,800 draws: a share's standard error is at most 0.0045; 5 of them is a failure, not noise.
    torch.testing.assert_close(share, p, atol=0.023, rtol=0)
    assert share[1] == 0 and share[5] == 0
    # Unnormalised rows (a sum that is not exactly 1 in float32) draw the same way.
    assert set(draw_tokens(probs * 3.0, torch.arange(n), n, generator, sampler).tolist()) <= {0, 2, 3, 4}

    # Rows 1, 4 and 6 of 8, alone, draw what they draw among all 8.
    mixed = torch.softmax(torch.randn(8, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    live = torch.tensor([1, 4, 6])
    for seed in range(20):
        full = draw_tokens(mixed, torch.arange(8), 8, torch.Generator().manual_seed(seed), sampler)
        part = draw_tokens(mixed[live], live, 8, torch.Generator().manual_seed(seed), sampler)
        assert torch.equal(full[live], part)


def test_an_unknown_sampler_is_refused():
    from distill.generate import draw_tokens

    with pytest.raises(ValueError, match="unknown sampler 'gumbel'; choose one of inverse-cdf, multinomial"):
        draw_tokens(torch.ones(1, 4) / 4, torch.arange(1), 1, torch.Generator(), "gumbel")


def test_auto_precision_trains_in_bf16_only_where_bf16_products_are_native(monkeypatch):
    from distill import precision as train

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert train.resolve_precision("auto", "cpu") == "fp32"          # AVX2: emulated bf16 is slower
    assert train.resolve_precision("bf16", "cpu") == "bf16"          # asked for: done, however slow
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert train.resolve_precision("auto", "cpu") == "bf16"
    assert train.resolve_precision("fp32", "cpu") == "fp32"
    assert train.resolve_precision("auto", "mps") == "fp32"          # the CPU's probes say nothing of it
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert train.resolve_precision("auto", "cpu") == "bf16"
    with pytest.raises(ValueError, match="unknown precision 'fp8'; choose one of auto, fp32, bf16"):
        train.resolve_precision("fp8", "cpu")


def test_bf16_training_gets_its_own_checkpoints_and_float32_keeps_its_names():
    import argparse

    from distill.phases import train_key
    from distill.run import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "x", "--layers", "2"])
    args.prompts_source = None
    assert train_key(args) == train_key(args, "fp32") == "v8192-l2-s300-b1024-lr0.001-kd0.5"
    assert train_key(args, "bf16") == "v8192-l2-s300-b1024-lr0.001-bf16-kd0.5"


@pytest.mark.parametrize("arch", ["lm", "eagle"])
def test_bf16_training_is_deterministic_and_named_in_the_card(arch, tiny_models, tmp_path):
    """--train-precision bf16 trains under a bfloat16 autocast: the same seed gives the same weights twice,
    other weights than float32 training, and the card and distill.json say which precision ran."""
    from safetensors.torch import load_file

    weights, cards = {}, {}
    # b starts afresh in a work folder of its own; c shares a's data, and must not resume a's checkpoints.
    for name, precision, work in (("a", "bf16", "w1"), ("b", "bf16", "w2"), ("c", "fp32", "w1")):
        out = tmp_path / name
        assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--arch", arch,
                         "--work-dir", str(tmp_path / work), "--train-precision", precision, *TINY_ARGS]) == 0
        weights[name] = load_file(out / "model.safetensors")
        cards[name] = (out / "README.md").read_text()
    assert all(torch.equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
    assert any(not torch.equal(weights["a"][k], weights["c"][k]) for k in weights["a"])
    assert "in bfloat16 products (autocast) (`--train-precision bf16`)" in cards["a"]
    assert "in float32 (`--train-precision fp32`)" in cards["c"]
    assert "sampled tokens drawn by inverse-cdf (`--sampler`)" in cards["a"]


@pytest.mark.parametrize("packed", [True, False])
def test_bf16_products_change_the_forward_only_inside_the_block(tiny_models, packed):
    """products_in(model, "bf16"): pre-packed layers repacked in bfloat16, any other linear layer swapped for
    one over a bfloat16 copy of its weight; outside the block the forward has its float32 bits again, over
    the same Parameters and modules."""
    from distill.precision import products_in
    from specmesh.fast_linear import packed_while

    model = load_model(str(tiny_models["target"])).model
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    ids = torch.tensor([[5, 9, 13, 17, 21, 25], [7, 8, 30, 31, 32, 33]])

    def logits():
        with torch.inference_mode():
            return model(input_ids=ids).logits.float()

    with packed_while(model) if packed else contextlib.nullcontext():
        modules = [type(m) for m in model.modules()]
        before = logits()
        with products_in(model, "fp32"):
            assert torch.equal(logits(), before)
        with products_in(model, "bf16"):
            inside = logits()
        after = logits()
        modules_after = [type(m) for m in model.modules()]
    assert not torch.equal(inside, before)
    assert (inside - before).abs().max() <= 0.1 * before.abs().max()     # rounded, not another model
    assert torch.equal(after, before)
    assert all(torch.equal(p, params[name]) for name, p in model.named_parameters())
    assert modules_after == modules


def test_bf16_generation_keeps_the_heldout_answers_in_float32(tiny_models, tmp_path):
    """--generation-precision bf16: the training data (template answers, the requests the target writes
    and its answers to them) come from bfloat16 products, in a work folder of their own; the held-out
    answers the card measures on are the float32 target's, bit for bit the answers of an fp32 run."""
    import argparse

    from distill.run import add_arguments, data_key

    runs = {}
    for precision in ("fp32", "bf16"):
        work = tmp_path / f"work-{precision}"
        assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(tmp_path / precision),
                         "--work-dir", str(work), *TINY_ARGS, "--self-prompts-per-category", "1",
                         "--generation-precision", precision]) == 0
        runs[precision] = {part: [e for path in sorted((work / "data").glob(f"{part}/shard-*.pt"))
                                  for e in torch.load(path, weights_only=False)]
                           for part in ("train", "heldout", "self-1/answers")}
        runs[precision]["written"] = json.loads((work / "data" / "self-1" / "prompts.json").read_text())
        runs[precision]["card"] = (tmp_path / precision / "README.md").read_text()
        runs[precision]["facts"] = json.loads((tmp_path / precision / "distill.json").read_text())["facts"]
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert len(fp32["heldout"]) == len(bf16["heldout"]) > 0
    for a, b in zip(fp32["heldout"], bf16["heldout"]):
        assert a["response_ids"] == b["response_ids"]
        assert torch.equal(a["features"], b["features"])
    # The training data did come from other products: some feature differs (to bf16's rounding).
    assert len(fp32["train"]) == len(bf16["train"]) > 0
    assert any(not torch.equal(a["features"], b["features"]) for a, b in zip(fp32["train"], bf16["train"])
               if a["response_ids"] == b["response_ids"])
    assert bf16["written"] and bf16["self-1/answers"]
    assert bf16["facts"]["generation_precision"] == "bf16" and fp32["facts"]["generation_precision"] == "fp32"
    assert "kernels (`--generation-kernels`) in bfloat16 products (`--generation-precision bf16`)" in bf16["card"]
    assert "in float32 (`--generation-precision fp32`)" in fp32["card"]
    assert "held-out answers in float32." in bf16["card"]

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--out", "x"])
    assert args.generation_precision == "auto"
    assert data_key(args, "t", True, "bf16") != data_key(args, "t", True, "fp32") == data_key(args, "t", True)


def test_bf16_generation_on_a_cpu_without_onednn_bf16_stops_before_the_data(tiny_models, tmp_path, capsys,
                                                                             monkeypatch):
    from specmesh import fast_linear

    monkeypatch.setattr(fast_linear, "bf16_available", lambda: False)
    argv = ["distill", "--target", str(tiny_models["target"]), "--out", str(tmp_path / "out"),
            "--work-dir", str(tmp_path / "work"), *TINY_ARGS, "--generation-precision", "bf16"]
    assert cli.main(argv) == 2
    assert "--generation-precision bf16: this CPU's oneDNN has no bfloat16 products" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "work" / "data").exists()
    assert cli.main(argv + ["--generation-kernels", "stock", "--stop-after", "data"]) == 0   # torch's bf16 products


def test_the_cache_goes_under_the_name_the_forward_takes():
    """transformers 5.x renamed forward's `past_key_values` to `cache`; either is found by signature."""
    from specmesh.models import cache_kwargs

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return past_key_values

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
            return cache

    marker = object()
    assert cache_kwargs(Old(), marker) == {"past_key_values": marker, "use_cache": True}
    assert cache_kwargs(New(), marker) == {"cache": marker, "use_cache": True}
    assert Old()(**cache_kwargs(Old(), marker)) is marker and New()(**cache_kwargs(New(), marker)) is marker


def test_python_dash_m_distill_is_the_same_command(tiny_models, tmp_path):
    """`python -m distill` (for a training box without the serving stack) takes the same arguments and
    refuses bad ones the same way: one clear line, exit 2, nothing written."""
    import subprocess
    import sys

    out = tmp_path / "draft"
    done = subprocess.run([sys.executable, "-m", "distill", "--target", str(tiny_models["target"]), "--out", str(out),
                           "--work-dir", str(tmp_path / "work"), "--steps", "0"],
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 2, done.stderr
    assert "--steps must be at least 1, got 0" in done.stderr
    assert not out.exists()


def test_distill_imports_none_of_the_serving_stack():
    """What `python -m distill` promises a training box: every module a run imports loads without
    gRPC, Redis or OpenTelemetry (a shared helper once pulled them in through specmesh.kv)."""
    import subprocess
    import sys

    modules = ["distill.__main__", "distill.run", "distill.phases", "distill.generate", "distill.train",
               "distill.eagle_train", "distill.evaluate", "distill.draft_model", "distill.card", "distill.vocab",
               "specmesh.eagle", "specmesh.distilled", "specmesh.models"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'grpc', 'redis', 'opentelemetry'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
