"""`specmesh bench --peers hf` on tiny random models: the HF peers run the same prompts
as our services and give the same greedy tokens (no timing is asserted)."""
from __future__ import annotations

import argparse
import json

import pytest

from specmesh_cli import bench, bench_peers

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["hello world, hello world, hello"]},
    {"question_id": 2, "category": "coding", "turns": ["abc abc abc abc 123"]},
]


@pytest.fixture
def bench_args(tmp_path, tiny_models):
    path = tmp_path / "questions.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--questions", str(path), "--model", str(tiny_models["target"]),
                              "--draft-model", str(tiny_models["draft"]), "--max-new-tokens", "24",
                              "--configs", "model:3,ngram:2", "--peers", "hf", "--peer-lookup-tokens", "2,5",
                              "--out", str(tmp_path / "out")])


def test_peers_run_interleaved_and_match_greedy_output(tiny_cluster, bench_args, capsys):
    questions = bench.load_questions(bench_args.questions, [], 1, [])
    rows = bench.measure(tiny_cluster.address, questions, bench.parse_configs(bench_args.configs), bench_args)

    peer_configs = ["hf:generate", "hf:lookup=2", "hf:lookup=5", "hf:assisted=2", "hf:assisted=3"]
    for q in QUESTIONS:
        configs = [r["config"] for r in rows if r["question_id"] == q["question_id"]]
        assert configs == ["target-only", *peer_configs, "model:k=3", "ngram:k=2"]
    peers = [r for r in rows if r["config"].startswith("hf:")]
    assert all(r["same_as_target_only"] is True for r in peers), [(r["config"], r["question_id"]) for r in peers]
    assert all(r["committed_tokens"] > 0 and r["steps"] > 0 for r in peers)
    # The assistant (the same draft as ours) commits more than one token per target forward somewhere.
    assert max(r["committed_per_step"] for r in peers if r["config"].startswith("hf:assisted")) > 1.0
    assert all(r["committed_per_step"] == pytest.approx(1.0, abs=0.05) for r in peers if r["config"] == "hf:generate")

    bench.report(rows, bench.parse_configs(bench_args.configs), bench_args.out)
    printed = capsys.readouterr().out
    summary = json.loads((bench_args.out / "results.json").read_text())["summary"]
    for category in ("writing", "coding", "overall"):
        assert {s["config"] for s in summary if s["category"] == category} >= {*peer_configs, "model:k=3"}
    assert "hf:lookup" in printed and "best setting" in printed
    # Our paths report the latencies servers are compared by; the in-process peers have no first token.
    ours = [s for s in summary if not s["config"].startswith("hf:")]
    assert all(s["ttft_p50_ms"] > 0 and s["tpot_ms"] > 0 and s["target_only_tpot_ms"] > 0 for s in ours)
    assert all(s["ttft_p50_ms"] is None and s["tpot_ms"] is None for s in summary if s["config"].startswith("hf:"))
    assert "ttft ms" in printed and "tpot ms" in printed
    assert (bench_args.out / "speedup.png").stat().st_size > 0


def test_latency_is_the_median_first_token_and_the_time_per_token_after_it():
    runs = [{"committed_tokens": 11, "elapsed_s": 1.2, "ttft_s": 0.2},
            {"committed_tokens": 21, "elapsed_s": 2.5, "ttft_s": 0.5},
            {"committed_tokens": 1, "elapsed_s": 0.4, "ttft_s": 0.4}]
    ttft, tpot = bench.latency(runs)
    assert ttft == pytest.approx(400.0)                       # the median of 200, 500, 400 ms
    assert tpot == pytest.approx(1000 * (1.0 + 2.0 + 0.0) / (10 + 20 + 0))
    assert bench.latency(runs + [{"committed_tokens": 5, "elapsed_s": 1.0, "ttft_s": None}]) == (None, None)


def test_a_draft_of_another_vocabulary_is_skipped_with_the_reason(tiny_models):
    peers = bench_peers.HFPeers.load(str(tiny_models["target"]), str(tiny_models["other_vocab"]), [3], [2], 0.0,
                                     threads=1)
    assert [name for name, _ in peers.settings()] == ["hf:generate", "hf:lookup=3"]
    assert "not a plain full-vocabulary LM" in peers.skipped[0] and "other" in peers.skipped[0]


def _distilled_like_draft(folder, target_info, draft_to_target, fingerprint=None):
    """A folder in the distilled-draft format: an LM over len(draft_to_target) + 1 ids and vocab_map.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(vocab_size=len(draft_to_target) + 1, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         tie_word_embeddings=True, initializer_range=0.5)
    LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "vocab_map.json").write_text(json.dumps({
        "format": "specmesh-distilled-draft/1", "target_name": target_info.name,
        "target_vocab_size": target_info.vocab_size, "target_fingerprint": fingerprint or target_info.vocab_fingerprint,
        "eos_token_ids": list(target_info.eos_token_ids), "max_context": 512, "draft_to_target": draft_to_target}))
    return folder


def test_a_distilled_draft_becomes_an_equivalent_full_vocabulary_assistant(tmp_path, tiny_models):
    import torch
    from transformers import AutoModelForCausalLM

    from specmesh.models import load_model

    target = load_model(str(tiny_models["target"]))
    subset = [2, 7, 5, 11, 20, 30, 31, 40]                         # includes EOS (2)
    folder = _distilled_like_draft(tmp_path / "draft", target.info, subset)
    small = AutoModelForCausalLM.from_pretrained(folder).eval()
    full = bench_peers.full_vocab_assistant(folder, target.info).model

    target_ids = torch.tensor([[7, 5, 3, 40, 9, 11]])              # 3 and 9 are outside the subset
    to_draft = {t: i for i, t in enumerate(subset)}
    draft_ids = torch.tensor([[to_draft.get(t, len(subset)) for t in target_ids[0].tolist()]])
    with torch.inference_mode():
        small_logits = small(draft_ids).logits                     # [1, 6, n + 1]
        full_logits = full(target_ids).logits                      # [1, 6, V_target]
    assert full_logits.shape[-1] == target.info.vocab_size
    assert torch.allclose(full_logits[..., subset], small_logits[..., :len(subset)], atol=1e-5)
    outside = torch.ones(target.info.vocab_size, dtype=torch.bool)
    outside[subset] = False
    assert bool((full_logits[..., outside] == torch.finfo(torch.float32).min).all())

    # Assisted generation with it stays the target's greedy output, and really runs the assistant.
    peers = bench_peers.HFPeers.load(str(tiny_models["target"]), str(folder), [], [3], 0.0, threads=1)
    assert [name for name, _ in peers.settings()] == ["hf:generate", "hf:assisted=3"]
    prompt = target.tokenizer("the cat sat on the mat").input_ids
    plain = peers.generate(prompt, 20, {}, seed=0)[0]
    assisted = peers.generate(prompt, 20, dict(peers.settings()[1][1]), seed=0)[0]
    assert assisted == plain


def test_a_distilled_draft_for_another_target_is_skipped(tmp_path, tiny_models):
    from specmesh.models import load_model

    info = load_model(str(tiny_models["target"])).info
    folder = _distilled_like_draft(tmp_path / "draft", info, [2, 7, 5], fingerprint="0123456789abcdef")
    peers = bench_peers.HFPeers.load(str(tiny_models["target"]), str(folder), [], [3], 0.0, threads=1)
    assert [name for name, _ in peers.settings()] == ["hf:generate"]
    assert "vocabulary map was made for" in peers.skipped[0]


def test_compare_bench_reads_tokens_per_step_and_each_runs_own_speedup(tmp_path):
    from tools.compare_bench import per_category

    header = "question_id,category,config,committed_tokens,elapsed_s,steps\n"
    rows = ["1,qa,target-only,100,10,100", "1,qa,eagle-hybrid:k=4,100,5,50",
            "2,rag,target-only,50,10,50", "2,rag,eagle-hybrid:k=4,60,6,20", "2,rag,eagle:k=4,60,1,10"]
    path = tmp_path / "results.csv"
    path.write_text(header + "\n".join(rows) + "\n")
    got = per_category(str(path), "eagle-hybrid:k=4")
    assert got["qa"] == (2.0, 2.0) and got["rag"] == (3.0, 2.0)       # 60 tok / 6 s against 50 tok / 10 s
    assert got["overall"] == (160 / 70, (160 / 11) / (150 / 20))


def test_compare_bench_pairs_two_runs_question_by_question(tmp_path):
    from tools.compare_bench import paired_difference, per_question

    header = "question_id,category,config,committed_tokens,elapsed_s,steps\n"
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    # Two repeats of question 1 sum before dividing; question 3 is only in run b and is left out.
    a.write_text(header + "1,qa,e:k=5,100,5,50\n1,qa,e:k=5,100,5,50\n2,rag,e:k=5,90,4,30\n2,rag,target-only,9,1,9\n")
    b.write_text(header + "1,qa,e:k=5,200,5,80\n2,rag,e:k=5,90,4,30\n3,qa,e:k=5,100,1,10\n")
    assert per_question(str(a), "e:k=5") == {"1": 2.0, "2": 3.0}
    n, mean, low, high = paired_difference(per_question(str(a), "e:k=5"), per_question(str(b), "e:k=5"))
    assert n == 2 and mean == pytest.approx(0.25)               # (2.5 - 2.0 + 0) / 2
    assert low == pytest.approx(0.0) and high == pytest.approx(0.5) and low <= mean <= high
    assert paired_difference({"1": 2.0}, {"1": 2.0}) == (1, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="share no question"):
        paired_difference({"1": 2.0}, {"2": 2.0})

    # A run that also asked second turns (`bench --turns all`): its first turns pair with a first-turn run.
    turns = tmp_path / "turns.csv"
    turns.write_text("question_id,turn,category,config,committed_tokens,elapsed_s,steps\n"
                     "1,1,qa,e:k=5,100,5,40\n1,2,qa,e:k=5,300,5,100\n2,1,rag,e:k=5,90,4,30\n")
    assert per_question(str(turns), "e:k=5") == {"1": 2.5, "1.2": 3.0, "2": 3.0}
    assert paired_difference(per_question(str(a), "e:k=5"), per_question(str(turns), "e:k=5"))[:2] == (2, 0.25)


def test_default_config_is_what_a_request_naming_nothing_gets(tiny_cluster, tiny_client):
    """`specmesh bench` with no --configs measures the server's default drafter and k, not a fixed one."""
    from specmesh.config import OrchestratorConfig

    drafter, k = bench.server_default(tiny_cluster.address)
    models = tiny_client.list_models()
    assert drafter == models.default_drafter and drafter in {d.name for d in models.drafters}
    assert k == OrchestratorConfig().default_k > 0
    completion = tiny_client.generate("hello world, hello world, hello", max_new_tokens=8)
    assert (completion.drafter, completion.k) == (drafter, k)     # what the plain request ran with
    assert bench.parse_configs(bench.DEFAULT_CONFIGS, (drafter, k)) == [(drafter, k)]
    assert bench.parse_configs("default,ngram:2,eagle", (drafter, k)) == [(drafter, k), ("ngram", 2), ("eagle", k)]
    assert bench.parse_configs("default", ("ngram", 0)) == []      # a default k of 0 is the baseline itself


def test_sampled_outputs_are_not_compared_with_target_only(tiny_cluster, bench_args, capsys):
    """At T > 0 the rule keeps the target's distribution, not target-only's sample: the bench says
    "- (sampled)" instead of a NO that would read as a broken rule."""
    bench_args.temperature, bench_args.peers, bench_args.configs = 0.8, "", "model:3"
    questions = bench.load_questions(bench_args.questions, [], 1, [])
    rows = bench.measure(tiny_cluster.address, questions, bench.parse_configs(bench_args.configs), bench_args)
    assert [r["same_as_target_only"] for r in rows] == [None] * len(rows) and rows
    bench.report(rows, bench.parse_configs(bench_args.configs), bench_args.out)
    summary = json.loads((bench_args.out / "results.json").read_text())["summary"]
    assert {s["outputs_equal_target_only"] for s in summary} == {None}
    assert "- (sampled)" in capsys.readouterr().out
    assert bench._all_equal([True, None, True]) is True and bench._all_equal([True, False]) is False
    # A question file of the user's own may name longer categories: the columns widen to keep them apart.
    for r in rows:
        r["category"] = "package-questions-long"
    bench.report(rows, bench.parse_configs(bench_args.configs), bench_args.out)
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("package-questions-long  target-only") for line in lines), lines
    assert any(line.startswith("package-questions-long  model:k=3") for line in lines), lines


TWO_TURNS = [{"question_id": 7, "category": "writing", "turns": ["hello world, hello", "abc abc abc abc"]},
             {"question_id": 8, "category": "coding", "turns": ["abc abc 123"]}]


def test_later_turns_follow_the_conversation_so_far(tiny_cluster, bench_args, tmp_path):
    """--turns all: a question's second turn is sent after its first and target-only's answer to it, to every
    configuration and peer alike; a one-turn question gives one turn."""
    from orchestrator.requests import tokenize_prompt
    from specmesh.client import Client, build_request
    from specmesh.models import load_tokenizer

    bench_args.questions.write_text("".join(json.dumps(q) + "\n" for q in TWO_TURNS))
    bench_args.turns = "all"
    questions = bench.load_questions(bench_args.questions, [], 1, [])
    rows = bench.measure(tiny_cluster.address, questions, bench.parse_configs(bench_args.configs), bench_args)

    configs = ["target-only", "model:k=3", "ngram:k=2", "hf:generate", "hf:lookup=2", "hf:lookup=5",
               "hf:assisted=2", "hf:assisted=3"]
    assert sorted((r["question_id"], r["turn"]) for r in rows) == sorted(
        (q, t) for q, t in [(7, 1), (7, 2), (8, 1)] for _ in configs)
    assert all(r["same_as_target_only"] for r in rows)
    with Client(tiny_cluster.address) as client:   # target-only's answer to the first turn, as the bench got it
        first = client.generate(TWO_TURNS[0]["turns"][0], chat=True, max_new_tokens=bench_args.max_new_tokens,
                                k=0, seed=7)
    conversation = [{"role": "user", "content": TWO_TURNS[0]["turns"][0]},
                    {"role": "assistant", "content": first.text},
                    {"role": "user", "content": TWO_TURNS[0]["turns"][1]}]
    tokenizer, _ = load_tokenizer(str(bench_args.model))
    wanted = len(tokenize_prompt(build_request(conversation), tokenizer))
    second = [r for r in rows if r["question_id"] == 7 and r["turn"] == 2]
    assert {r["prompt_tokens"] for r in second} == {wanted}
    assert wanted > next(r["prompt_tokens"] for r in rows if r["question_id"] == 7 and r["turn"] == 1) + len(first.text) // 2

    bench.report(rows, bench.parse_configs(bench_args.configs), tmp_path / "report")
    assert "turn" in (tmp_path / "report" / "results.csv").read_text().splitlines()[0].split(",")


@pytest.mark.parametrize("turns, no_chat, message", [("0", False, "1 or more"), ("two", False, "or 'all'"),
                                                     ("2", True, "needs the chat template")])
def test_bad_turns_are_refused(turns, no_chat, message):
    with pytest.raises(SystemExit, match=message):
        bench.turns_wanted(turns, chat=not no_chat)
