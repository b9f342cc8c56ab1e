"""Compare one configuration across two or more `specmesh bench` runs, per category, as a table and a PNG.

    python -m tools.compare_bench --config eagle-hybrid:k=4 --out docs/img/chain-vs-tree.png \
        chain=/work/runs/s8/bench/results.csv tree=/work/runs/s9/bench/results.csv

For each run: committed tokens per step, and the speedup over that run's own
target-only rows (so each ratio was measured under one machine load). Used for
changes that the bench cannot A/B in one run, such as a draft-tier setting.
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
