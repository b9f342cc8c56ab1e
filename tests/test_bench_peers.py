"""`specmesh bench --peers hf` on tiny random models: the HF peers run the same prompts
as our services and give the same greedy tokens (no timing is asserted)."""
from __future__ import annotations

import argparse
import json

import pytest

from specmesh import bench, bench_peers

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
    assert all(r["generated_tokens"] > 0 and r["steps"] > 0 for r in peers)
    # The assistant (the same draft as ours) commits more than one token per target forward somewhere.
    assert max(r["mean_accepted_per_step"] for r in peers if r["config"].startswith("hf:assisted")) > 1.0
    assert all(r["mean_accepted_per_step"] == pytest.approx(1.0, abs=0.05) for r in peers if r["config"] == "hf:generate")

    bench.report(rows, bench.parse_configs(bench_args.configs), bench_args.out)
    printed = capsys.readouterr().out
    summary = json.loads((bench_args.out / "results.json").read_text())["summary"]
    for category in ("writing", "coding", "overall"):
        assert {s["config"] for s in summary if s["category"] == category} >= {*peer_configs, "model:k=3"}
    assert "hf:lookup" in printed and "best setting" in printed
    assert (bench_args.out / "speedup.png").stat().st_size > 0


def test_a_draft_of_another_vocabulary_is_skipped_with_the_reason(tiny_models):
    peers = bench_peers.HFPeers.load(str(tiny_models["target"]), str(tiny_models["other_vocab"]), [3], [2], 0.0,
                                     threads=1)
    assert [name for name, _ in peers.settings()] == ["hf:generate", "hf:lookup=3"]
    assert "not a plain full-vocabulary LM" in peers.skipped[0] and "other" in peers.skipped[0]
