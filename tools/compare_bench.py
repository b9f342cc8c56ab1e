"""Compare one configuration across two or more `specmesh bench` runs, per category, as a table and a PNG.

    python -m tools.compare_bench --config eagle-hybrid:k=4 --out docs/img/chain-vs-tree.png \
        chain=/work/runs/s8/bench/results.csv tree=/work/runs/s9/bench/results.csv

For each run: committed tokens per step, and the speedup over that run's own
target-only rows (so each ratio was measured under one machine load). Used for
changes that the bench cannot A/B in one run, such as a draft-tier setting or a
new draft. With exactly two runs it also pairs them question by question: the
mean difference of tokens per step and its 95% bootstrap interval over the
questions both ran (greedy answers are the same in both, so a question is its
own control; two questions a category cannot rank drafts by category alone).
"""
from __future__ import annotations

import argparse
import csv
from collections import defaultdict


def per_category(path: str, config: str) -> dict[str, tuple[float, float]]:
    """category -> (committed tokens per step, speedup over target-only) for `config` in one results.csv."""
    sums = defaultdict(lambda: defaultdict(float))
    for row in csv.DictReader(open(path)):
        if row["config"] not in (config, "target-only"):
            continue
        for category in (row["category"], "overall"):
            s = sums[category]
            if row["config"] == config:
                s["tokens"] += float(row["committed_tokens"])
                s["steps"] += float(row["steps"])
                s["seconds"] += float(row["elapsed_s"])
            else:
                s["base_tokens"] += float(row["committed_tokens"])
                s["base_seconds"] += float(row["elapsed_s"])
    return {c: (s["tokens"] / s["steps"], (s["tokens"] / s["seconds"]) / (s["base_tokens"] / s["base_seconds"]))
            for c, s in sums.items() if s["steps"] and s["base_seconds"]}


def per_question(path: str, config: str) -> dict[str, float]:
    """question id (with ".2" for a second turn, `bench --turns`) -> committed tokens per step for `config`
    (summed over repeats) in one results.csv. A first turn keeps the bare id, so a first-turn run pairs
    with the first turns of a run that also asked later ones (and with runs from before the column)."""
    sums = defaultdict(lambda: [0.0, 0.0])
    for row in csv.DictReader(open(path)):
        if row["config"] == config:
            turn = row.get("turn") or "1"
            key = row["question_id"] if turn == "1" else f"{row['question_id']}.{turn}"
            sums[key][0] += float(row["committed_tokens"])
            sums[key][1] += float(row["steps"])
    return {q: tokens / steps for q, (tokens, steps) in sums.items() if steps}


def paired_difference(a: dict[str, float], b: dict[str, float], resamples: int = 10_000,
                      seed: int = 0) -> tuple[int, float, float, float]:
    """(questions, mean of b - a, 2.5th and 97.5th percentile of that mean over bootstrap resamples of the
    questions both hold)."""
    import random

    diffs = [b[q] - a[q] for q in sorted(set(a) & set(b))]
    if not diffs:
        raise ValueError("the two runs share no question for this config")
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=len(diffs))) / len(diffs) for _ in range(resamples))
    return len(diffs), sum(diffs) / len(diffs), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="NAME=path/to/results.csv")
    parser.add_argument("--config", required=True, help="the bench's config label, e.g. eagle-hybrid:k=4")
    parser.add_argument("--out", help="PNG to write")
    args = parser.parse_args()
    runs = dict(run.split("=", 1) for run in args.runs)
    data = {name: per_category(path, args.config) for name, path in runs.items()}
    categories = sorted({c for d in data.values() for c in d} - {"overall"}) + ["overall"]
    print(f"{'category':16}" + "".join(f" | {name} tok/step | {name} speedup" for name in runs))
    for c in categories:
        print(f"{c:16}" + "".join(f" | {data[n][c][0]:.2f} | {data[n][c][1]:.2f}x" if c in data[n] else " | - | -"
                                  for n in runs))
    if len(runs) == 2:
        (name_a, path_a), (name_b, path_b) = runs.items()
        n, mean, low, high = paired_difference(per_question(path_a, args.config), per_question(path_b, args.config))
        print(f"paired over {n} questions: {name_b} - {name_a} = {mean:+.3f} tokens per step "
              f"(95% bootstrap interval {low:+.3f} to {high:+.3f})")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(15, 4))
        width = 0.8 / len(runs)
        for ax, index, title in ((axes[0], 0, f"committed tokens per step, {args.config}"),
                                 (axes[1], 1, "speedup over target-only (each run's own)")):
            for j, name in enumerate(runs):
                ax.bar([i + width * j for i in range(len(categories))],
                       [data[name].get(c, (0.0, 0.0))[index] for c in categories], width, label=name)
            ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(categories))])
            ax.set_xticklabels(categories, rotation=45, ha="right")
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_title(title)
        axes[0].legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
