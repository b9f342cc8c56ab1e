"""The held-out requests of a `--prompts-file` as a question file for `specmesh bench`.

`specmesh distill --prompts-file F --heldout-per-category N --seed S` holds out the same requests this
writes (distill.prompts_file.load_for_training, same arguments), so a bench of the file's held-out requests
measures a draft, through the services, on requests it never trained on:

    python -m tools.heldout_questions requests.jsonl --heldout-per-category 8 --seed 0 --out heldout.jsonl
    specmesh bench --questions heldout.jsonl --per-category 8 --configs default --eagle-model my-eagle

The bench sends one user turn, so a conversation becomes its last user turn alone (its context dropped).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from distill.prompts_file import PromptsFileError, load_for_training

FIRST_ID = 900_000      # far above Spec-Bench's question ids, so the two never meet in one results file


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.heldout_questions", description=__doc__.splitlines()[0])
    p.add_argument("prompts_file", type=Path)
    p.add_argument("--heldout-per-category", type=int, required=True, help="as given to specmesh distill")
    p.add_argument("--seed", type=int, required=True, help="as given to specmesh distill")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        source = load_for_training(args.prompts_file, args.heldout_per_category, args.seed, chat_template=True)
    except PromptsFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        for i, prompt in enumerate(source.heldout):
            f.write(json.dumps({"question_id": FIRST_ID + i, "category": prompt.category, "turns": [prompt.text]}) + "\n")
    print(f"wrote {len(source.heldout)} held-out requests to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
