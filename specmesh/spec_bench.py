"""Where a checkout finds the Spec-Bench questions: the benchmark `specmesh bench` and `specmesh soak`
send, and the text `specmesh distill` keeps out of its training data.

The file lives beside the repository (``../shared/bench``), not in it, so an
installed package has none: the bench and soak commands take ``--questions`` /
``--prompts`` for another copy, and distill's filter has nothing to drop against.
"""
from __future__ import annotations

from pathlib import Path

QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "bench" / "spec_bench_questions.jsonl"
