"""`specmesh distill --prompts-file`: a draft trained on the user's own requests.

The reader (distill/prompts_file.py) is tested on its own; one tiny distill run
then trains on a file alone and checks what reached the data, the card and the
held-out table.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from distill.prompts_file import DEFAULT_CATEGORY, PromptsFileError, load
from specmesh_cli import cli

TINY_ARGS = ["--heldout-per-category", "1", "--max-new-tokens", "8", "--batch-size", "8", "--vocab", "24",
             "--layers", "1", "--steps", "4", "--train-batch-tokens", "256", "--checkpoint-every", "2", "--seed", "5",
             "--threads", "1"]


def _write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_every_shape_of_request_reads_as_the_conversation_up_to_its_last_user_turn(tmp_path):
    path = _write(tmp_path / "p.jsonl", [
        "a bare string",
        {"prompt": "a completion prompt", "category": "support"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
                      {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second"},
                      {"role": "assistant", "content": "somebody else's answer"}]},
        {"conversations": [{"from": "human", "value": "sharegpt question"}, {"from": "gpt", "value": "reply"}]},
    ])
    source = load(path, heldout_per_category=0, seed=0, chat_template=True)
    assert source.lines == 4 and not source.dropped and not source.heldout
    by_text = {p.text: p for p in source.train}
    assert by_text["a bare string"].messages == (("user", "a bare string"),)
    assert by_text["a bare string"].category == DEFAULT_CATEGORY
    assert by_text["a completion prompt"].category == "support"
    # The target answers "second"; the file's answer after it is never part of the request.
    assert by_text["second"].messages == (("system", "be brief"), ("user", "first"), ("assistant", "an answer"),
                                          ("user", "second"))
    assert by_text["sharegpt question"].messages == (("user", "sharegpt question"),)
    assert len(source.sha256) == 64 and source.folder_name == f"file-{source.sha256[:12]}"


def test_duplicates_and_bench_questions_are_left_out_and_counted(tmp_path):
    path = _write(tmp_path / "p.jsonl", ["keep me", "keep me", "a benchmark turn", {"prompt": "keep me too"}])
    source = load(path, 0, 0, True, keep=lambda text: "benchmark" not in text)
    assert sorted(p.text for p in source.train) == ["keep me", "keep me too"]
    assert source.dropped == {"duplicate": 1, "matches a Spec-Bench question": 1}


def test_held_out_requests_are_per_category_at_most_half_and_follow_the_seed(tmp_path):
    records = [{"prompt": f"a {i}", "category": "a"} for i in range(10)] + [{"prompt": "b 0", "category": "b"}]
    path = _write(tmp_path / "p.jsonl", records)
    source = load(path, heldout_per_category=3, seed=1, chat_template=True)
    held = [p for p in source.heldout]
    assert [p.category for p in held] == ["a"] * 3          # "b" has one request: it trains, none held out
    assert len(source.train) == 8 and not {p.text for p in held} & {p.text for p in source.train}
    assert [p.text for p in load(path, 3, 1, True).heldout] == [p.text for p in held]
    assert {p.text for p in load(path, 5, 1, True).heldout} != {p.text for p in load(path, 5, 2, True).heldout}
    assert len(load(path, 9, 1, True).heldout) == 5          # never more than half of a category


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "line 1: not JSON"),
    (["\"ok\"", json.dumps({"text": "x"})], "line 2: expected a string or an object with \"prompt\""),
    ([json.dumps({"messages": [{"role": "assistant", "content": "x"}]})], "line 1: the conversation has no user turn"),
    ([json.dumps({"messages": [{"role": "robot", "content": "x"}]})], "messages[0] has role 'robot'"),
    ([json.dumps({"conversations": [{"from": "human"}]})], "conversations[0] needs a string \"value\""),
    ([json.dumps({"messages": []})], "\"messages\" must be a non-empty list"),
    ([json.dumps({"prompt": "x", "category": 3})], "\"category\" must be a non-empty string"),
    ([json.dumps({"prompt": "   "})], "the last user turn is empty"),
    ([], "holds no request to train on (it is empty)"),
])
def test_a_bad_file_is_refused_naming_the_line(tmp_path, lines, message):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(PromptsFileError, match=r"--prompts-file .*p\.jsonl") as error:
        load(path, 0, 0, True)
    assert message in str(error.value)


def test_a_conversation_needs_a_chat_template_and_a_file_of_bench_questions_trains_nothing(tmp_path):
    path = _write(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                       {"role": "assistant", "content": "b"},
                                                       {"role": "user", "content": "c"}]}])
    with pytest.raises(PromptsFileError, match="line 1: a conversation of 3 turns needs a target with a chat template"):
        load(path, 0, 0, chat_template=False)
    assert load(_write(tmp_path / "one.jsonl", ["one turn"]), 0, 0, chat_template=False).train[0].text == "one turn"
    with pytest.raises(PromptsFileError, match=r"no request to train on \(1 read, left out: 1 matches a Spec-Bench"):
        load(_write(tmp_path / "bench.jsonl", ["q"]), 0, 0, True, keep=lambda text: False)


def _requests() -> list:
    """Lowercase ASCII: the tiny target's alphabet."""
    support = [{"prompt": f"how do i reset my password on device {i}?", "category": "support"} for i in range(6)]
    chats = [{"messages": [{"role": "user", "content": f"hello number {i}"},
                           {"role": "assistant", "content": "hi, what can i do?"},
                           {"role": "user", "content": f"tell me a fact about {i}"}]} for i in range(5)]
    return support + chats + [support[0]]


@pytest.fixture(scope="module")
def from_file(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("from-file")
    path = _write(root / "requests.jsonl", _requests())
    out, work = root / "draft", root / "work"
    code = cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir", str(work),
                     "--prompts-per-category", "0", "--prompts-file", str(path), *TINY_ARGS])
    assert code == 0
    return path, out, work


def test_distill_trains_on_the_file_alone_and_reports_its_categories(from_file, tiny_models):
    from distill.generate import load_examples
    from specmesh.distilled import load_draft
    from specmesh.models import load_model, load_tokenizer

    path, out, work = from_file
    facts = json.loads((out / "distill.json").read_text())["facts"]
    file_facts = facts["prompts_file"]
    # 12 lines, one a duplicate; one request of each category held out.
    assert (file_facts["requests"], file_facts["train"], file_facts["heldout"]) == (12, 9, 2)
    assert file_facts["left_out"] == {"duplicate": 1}
    assert file_facts["categories"] == [DEFAULT_CATEGORY, "support"]
    assert facts["train_examples"] == 9, "templates were trained on with --prompts-per-category 0"
    acceptance = json.loads((out / "distill.json").read_text())["acceptance"]
    assert {"support", DEFAULT_CATEGORY, "overall"} <= set(acceptance)
    assert acceptance["support"]["answers"] == 1 and acceptance[DEFAULT_CATEGORY]["answers"] == 1
    card = (out / "README.md").read_text()
    assert f"--prompts-file {path}" in card and file_facts["sha256"][:16] in card and "| support |" in card
    assert "left out: 1 duplicate" in card
    assert "written from templates" not in card, "the card names template prompts it did not train on"

    # What the target answered is each conversation in its chat template, ending at the user's last turn.
    tokenizer, _ = load_tokenizer(str(tiny_models["target"]))
    shards = sorted((work / "data").glob("file-*/train/shard-*.pt"))
    rendered = [tokenizer.decode(e["prompt_ids"]) for e in load_examples(shards)]
    chats = [r for r in rendered if "hello number" in r]
    assert len(chats) == 4 and all(r.startswith("<s>user: hello number") for r in chats)
    assert all("<s>assistant: hi, what can i do?\n<s>user: tell me a fact about" in r for r in chats)
    assert all(r.endswith("<s>assistant: ") for r in rendered)
    assert load_draft(str(out), target=load_model(str(tiny_models["target"])).info).vocab_map


def test_another_file_trains_into_its_own_folders(from_file, tiny_models, tmp_path):
    path, out, work = from_file
    other = _write(tmp_path / "other.jsonl", _requests()[:-1] + ["one more request"])
    before = {p.name for p in work.glob("train-*")}
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(tmp_path / "out"), "--work-dir",
                     str(work), "--prompts-per-category", "0", "--prompts-file", str(other), *TINY_ARGS]) == 0
    assert len({p.name for p in work.glob("train-*")} - before) == 1
    assert len(list((work / "data").glob("file-*"))) == 2
    assert torch.load(next((work / "data").glob("file-*/train/shard-00000.pt")), weights_only=False)


def test_a_bad_line_stops_the_run_before_any_generation(tiny_models, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('"fine"\n{"messages": "not a list"}\n')
    out, work = tmp_path / "out", tmp_path / "work"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir", str(work),
                     "--prompts-file", str(path), *TINY_ARGS]) == 2
    err = capsys.readouterr().err
    assert f"--prompts-file {path}, line 2: \"messages\" must be a non-empty list" in err
    assert not out.exists() and not (work / "data").exists()


# --------------------------------------------------------------------------- --init-from: start from a draft


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {f"{path.name}:{name}": tensor for path in sorted(folder.glob("*.safetensors"))
            for name, tensor in load_file(str(path)).items()}


def test_init_from_with_no_steps_measures_the_starting_draft_as_it_is(from_file, tiny_models, tmp_path):
    """--steps 0: the card measures the starting draft on the held-out requests; the folder keeps its
    vocabulary and weights bit for bit, so its table is the starting draft's own (float16 as stored)."""
    path, start, work = from_file
    out = tmp_path / "measured"
    assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir", str(work),
                     "--prompts-per-category", "0", "--prompts-file", str(path), "--init-from", str(start),
                     *TINY_ARGS, "--steps", "0"]) == 0
    mine, theirs = _weights(out), _weights(start)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert json.loads((out / "vocab_map.json").read_text())["draft_to_target"] == \
        json.loads((start / "vocab_map.json").read_text())["draft_to_target"]
    acceptance = json.loads((out / "distill.json").read_text())["acceptance"]
    assert acceptance["support"]["answers"] == 1 and acceptance["overall"]["tokens"] > 0
    card = (out / "README.md").read_text()
    assert "training: none (`--steps 0`)" in card and f"the draft `{start}`" in card


def test_init_from_trains_an_eagle_draft_further_on_its_own_vocabulary(tiny_models, tmp_path):
    start, work = tmp_path / "start", tmp_path / "work"
    argv = ["distill", "--target", str(tiny_models["target"]), "--work-dir", str(work), "--arch", "eagle", *TINY_ARGS]
    assert cli.main([*argv, "--out", str(start), "--prompts-per-category", "1"]) == 0
    requests = _write(tmp_path / "requests.jsonl", _requests())
    out = tmp_path / "further"
    assert cli.main([*argv, "--out", str(out), "--prompts-per-category", "0", "--prompts-file", str(requests),
                     "--init-from", str(start)]) == 0
    assert json.loads((out / "vocab_map.json").read_text())["draft_to_target"] == \
        json.loads((start / "vocab_map.json").read_text())["draft_to_target"]
    mine, theirs = _weights(out), _weights(start)
    assert mine.keys() == theirs.keys()
    assert not torch.equal(mine["eagle.safetensors:fc.weight"], theirs["eagle.safetensors:fc.weight"])
    assert any("-init" in p.name for p in work.glob("train-*"))
    assert "--init-from" in (out / "README.md").read_text()


def test_init_from_refuses_what_does_not_fit_before_any_generation(from_file, tiny_models, tmp_path, capsys):
    import shutil

    _, start, _ = from_file
    foreign = tmp_path / "foreign"
    shutil.copytree(start, foreign)
    vocab_map = json.loads((foreign / "vocab_map.json").read_text())
    vocab_map["target_fingerprint"] = "0" * len(vocab_map["target_fingerprint"])
    (foreign / "vocab_map.json").write_text(json.dumps(vocab_map))
    cases = [
        (["--init-from", str(tmp_path)], f"--init-from {tmp_path} is not a draft folder"),
        (["--init-from", str(start), "--arch", "eagle"], "is a plain draft; pass --arch lm"),
        (["--init-from", str(start), "--layers", "2"], "--layers 2 differs from --init-from"),
        (["--init-from", str(foreign)], "its vocabulary map does not fit target"),
        (["--steps", "0"], "--steps must be at least 1, got 0"),
    ]
    for extra, message in cases:
        out, work = tmp_path / "out", tmp_path / "work"
        assert cli.main(["distill", "--target", str(tiny_models["target"]), "--out", str(out), "--work-dir",
                         str(work), *TINY_ARGS, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
        assert not out.exists() and not (work / "data").exists(), extra


# --------------------------------------------------------------------------- the tools around it


def test_the_held_out_requests_become_a_question_file_the_bench_reads(tmp_path, capsys):
    """tools.heldout_questions writes exactly the requests distill holds out (same file, split and seed),
    each as its last user turn, in the question format `specmesh bench --questions` reads."""
    from specmesh_cli import bench
    from tools import heldout_questions

    path = _write(tmp_path / "requests.jsonl", _requests())
    out = tmp_path / "heldout.jsonl"
    assert heldout_questions.main([str(path), "--heldout-per-category", "2", "--seed", "7", "--out", str(out)]) == 0
    held = load(path, 2, 7, True).heldout
    questions = bench.load_questions(out, [], 10, [])
    assert [(q["category"], q["turns"]) for q in questions] == [(p.category, [p.text]) for p in held]
    assert len(questions) == 4 and all(q["question_id"] >= heldout_questions.FIRST_ID for q in questions)
    assert heldout_questions.main([str(tmp_path / "none.jsonl"), "--heldout-per-category", "2", "--seed", "7",
                                   "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_package_requests_are_a_prompts_file_in_three_categories(tmp_path):
    from tools import package_requests

    status = tmp_path / "status"
    status.write_text("".join(
        f"Package: pkg{i}\nStatus: install ok installed\nDescription: tool number {i}\n a longer text\n .\n"
        f" about tool {i}\n\n" for i in range(6)))
    out = tmp_path / "requests.jsonl"
    assert package_requests.main(["--status", str(status), "--out", str(out)]) == 0
    source = load(out, 0, 0, True)
    assert source.lines == 6 and not source.dropped
    counts = {c: sum(p.category == c for p in source.train) for c in ("package-notes", "package-questions", "ops-chat")}
    assert counts == {"package-notes": 2, "package-questions": 2, "ops-chat": 2}
    notes = [p.text for p in source.train if p.category == "package-notes"]
    assert all("a longer text about tool" in t for t in notes)
    assert all(len(p.messages) == 3 for p in source.train if p.category == "ops-chat")
