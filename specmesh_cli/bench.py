"""`specmesh bench`: speedup over target-only decoding on Spec-Bench prompts.

Every prompt is run with k = 0 (target-only decoding through the same
services: the baseline) and with each speculative configuration, one after
the other in the same run, so the ratios are measured under the same machine
load. Greedy by default, as Spec-Bench reports; each speculative output is
also checked against the baseline token for token.

Prints a table per category and overall; writes results.json, results.csv
and speedup.png (speedup and committed tokens per step by category).
"""
from __future__ import annotations

import csv
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from specmesh import spec_bench
from specmesh_cli import bench_peers, launcher

log = logging.getLogger("specmesh.bench")


DEFAULT_CONFIGS = "default"   # --configs: what a request that names no drafter and no k gets


def add_arguments(p) -> None:
    p.add_argument("--addr", default=None, help="a running orchestrator; default: start one (like `specmesh up`)")
    p.add_argument("--model", default=None, help="target model when starting services [SPECMESH_MODEL]")
    p.add_argument("--draft-model", default=None, help="draft model when starting services")
    p.add_argument("--eagle-model", default=None,
                   help="EAGLE draft (the `eagle` drafter) when starting services; default: the target's shipped one")
    p.add_argument("--questions", type=Path, default=spec_bench.QUESTIONS, help="Spec-Bench question.jsonl")
    p.add_argument("--categories", default="", help="comma-separated categories (default: all)")
    p.add_argument("--question-ids", default="", help="comma-separated question ids (overrides --per-category)")
    p.add_argument("--per-category", type=int, default=1, help="questions taken from each category")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help="speculative configurations DRAFTER[:K] (no K: the server's default k), comma-separated "
                        "(the k=0 baseline is always run); "
                        f"{DEFAULT_CONFIGS!r}: what a request that names none gets (the server's default drafter "
                        "and k, from ListModels)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1,
                   help="run every prompt and configuration this many times, interleaved (less noise)")
    p.add_argument("--no-chat", action="store_true", help="send the raw question instead of a chat turn")
    p.add_argument("--turns", default="1",
                   help="turns of each question to answer: 1 (the first), N, or 'all'. A later turn is sent after "
                        "the earlier ones and target-only's answers to them, as Spec-Bench runs its multi-turn "
                        "categories; each turn is a run of its own in the table")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="folder for json, csv and png")
    launcher.add_thread_arguments(p)
    bench_peers.add_arguments(p)


def load_questions(path: Path, categories: list[str], per_category: int, ids: list[int]) -> list[dict]:
    if not path.exists():
        raise SystemExit(f"no Spec-Bench questions at {path}; pass --questions")
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if ids:
        by_id = {q["question_id"]: q for q in questions}
        missing = [i for i in ids if i not in by_id]
        if missing:
            raise SystemExit(f"unknown question ids: {missing}")
        return [by_id[i] for i in ids]
    chosen, taken = [], defaultdict(int)
    for q in questions:
        if (not categories or q["category"] in categories) and taken[q["category"]] < per_category:
            chosen.append(q)
            taken[q["category"]] += 1
    return chosen


def parse_configs(text: str, default: tuple[str, int] | None = None) -> list[tuple[str, int]]:
    """"ngram:4,eagle:5" -> [("ngram", 4), ("eagle", 5)]; DEFAULT_CONFIGS (alone or in the list) is `default`,
    the server's default drafter and k (skipped while unknown); a drafter without :K gets the default's k."""
    configs = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if item == DEFAULT_CONFIGS:
            configs += [default] if default and default[1] > 0 else []   # a default k of 0 is the baseline
            continue
        drafter, _, k = item.partition(":")
        configs.append((drafter, int(k) if k else default[1] if default else 4))
    return configs


def turns_wanted(text: str, chat: bool) -> int:
    """--turns as the most turns of a question to answer (a very large number for 'all')."""
    if text == "all":
        turns = sys.maxsize
    elif text.isdigit() and int(text) >= 1:
        turns = int(text)
    else:
        raise SystemExit(f"--turns must be a number of turns (1 or more) or 'all', not {text!r}")
    if turns > 1 and not chat:
        raise SystemExit("--turns beyond the first needs the chat template: a raw prompt has no turns (drop --no-chat)")
    return turns


def run(args) -> int:
    from specmesh_cli.launcher import Cluster

    turns_wanted(args.turns, chat=not args.no_chat)   # refused before anything starts
    questions = load_questions(args.questions, [c for c in args.categories.split(",") if c], args.per_category,
                               [int(i) for i in args.question_ids.split(",") if i])
    cluster = None
    address = args.addr
    if address is None:
        from specmesh_cli.ports import free_port

        from specmesh.drafts import draft_for, eagle_for

        cluster = Cluster(model=args.model, draft_model=draft_for(args.model, args.draft_model),
                          eagle_model=eagle_for(args.model, args.eagle_model), port=free_port(),
                          draft_torch_threads=args.draft_torch_threads,
                          verifier_torch_threads=args.verifier_torch_threads, log_dir=args.out / "logs")
        log.info("starting services (logs in %s)", args.out / "logs")
        cluster.start()
        address = cluster.address
    try:
        configs = parse_configs(args.configs, server_default(address))
        rows = measure(address, questions, configs, args)
    finally:
        if cluster is not None:
            cluster.stop()
    report(rows, configs, args.out)
    return 0


def server_default(address: str) -> tuple[str, int]:
    """(drafter, k) of a request that names neither, as the orchestrator at `address` serves them."""
    from specmesh.client import Client

    with Client(address) as client:
        models = client.list_models()
    return models.default_drafter, models.default_k


def measure(address: str, questions: list[dict], configs: list[tuple[str, int]], args) -> list[dict]:
    from specmesh.client import Client

    rows = []
    peers = _load_peers(args, configs)
    turns = turns_wanted(args.turns, chat=not args.no_chat)
    with Client(address) as client:
        # One untimed request so that lazy initialisation is not billed to the first prompt.
        client.generate("Hello", chat=not args.no_chat, max_new_tokens=4, k=0)
        runs_per_turn = len(configs) + 1 + (len(peers.settings()) if peers else 0)
        progress = _Progress(sum(min(turns, len(q["turns"])) for q in questions) * runs_per_turn * args.repeats)
        for q in [q for q in questions for _ in range(args.repeats)]:
            # Every configuration answers a turn after the same conversation: the earlier turns with
            # target-only's answers (what each of them gives too, when greedy).
            conversation: list[dict] = []
            for turn, text in enumerate(q["turns"][:turns], 1):
                conversation.append({"role": "user", "content": text})
                prompt = text if args.no_chat else list(conversation)
                baseline = _run_turn(client, peers, q, turn, prompt, configs, args, rows, progress)
                conversation.append({"role": "assistant", "content": baseline.text})
    return rows


class _Progress:
    """Runs done of the total, and the time left at this pace, for the line each run prints."""

    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def tick(self, runs: int = 1) -> float:
        self.done += runs
        return (time.perf_counter() - self.started) / self.done * (self.total - self.done)


def _run_turn(client, peers, q: dict, turn: int, prompt, configs, args, rows: list[dict], progress: _Progress):
    """One turn of a question: target-only, then each configuration (and the peers after target-only);
    appends their rows and returns target-only's completion."""
    baseline = None
    for drafter, k in [("", 0)] + configs:
        c = client.generate(prompt, chat=not args.no_chat, max_new_tokens=args.max_new_tokens, k=k,
                            drafter=drafter, temperature=args.temperature, seed=q["question_id"])
        s = c.stats
        if baseline is None:
            baseline = c
        rows.append({"question_id": q["question_id"], "turn": turn, "category": q["category"],
                     "config": "target-only" if k == 0 else f"{drafter}:k={k}", "drafter": drafter, "k": k,
                     "prompt_tokens": s.prompt_tokens, "committed_tokens": s.committed_tokens,
                     "elapsed_s": s.elapsed_s,
                     "ttft_s": s.time_to_first_token_s if s.committed_tokens else None,
                     "tokens_per_second": s.tokens_per_second, "steps": s.steps,
                     "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
                     "acceptance_rate": s.acceptance_rate, "committed_per_step": s.committed_per_step,
                     # Sampled runs draw other random numbers than target-only's (the rule keeps
                     # the distribution, not the sample), so only greedy outputs can be compared.
                     "same_as_target_only": c.token_ids == baseline.token_ids if not args.temperature
                     else None})
        eta = progress.tick()
        print(f"[{progress.done}/{progress.total}] {_label(q, turn)} {q['category']:<14} {rows[-1]['config']:<12} "
              f"{s.committed_tokens:4d} tok {s.tokens_per_second:6.1f} tok/s  "
              f"accept {s.acceptance_rate:4.2f}  per step {s.committed_per_step:4.2f}  "
              f"(eta {eta:4.0f} s)", file=sys.stderr, flush=True)
        if k == 0 and peers:   # the same prompt through the HF peers, right after our baseline
            rows.extend(_run_peers(peers, q, turn, prompt, baseline, args))
            progress.tick(len(peers.settings()))
    return baseline


def _label(q: dict, turn: int) -> str:
    """A run's question in the progress lines: q81, and q81.2 for its second turn."""
    return f"q{q['question_id']}" + (f".{turn}" if turn > 1 else "")


def _load_peers(args, configs: list[tuple[str, int]]) -> "bench_peers.HFPeers | None":
    if not getattr(args, "peers", ""):
        return None
    lookup = [int(n) for n in args.peer_lookup_tokens.split(",") if n.strip()]
    assistant = [int(n) for n in args.peer_assistant_tokens.split(",") if n.strip()] or sorted(
        {k for _, k in configs if k}) or [4]
    from specmesh.drafts import draft_for

    # The same draft our services run (the shipped one by default), as HF's assistant model.
    return bench_peers.HFPeers.load(args.model, draft_for(args.model, args.draft_model), lookup, assistant,
                                    args.temperature, threads=args.verifier_torch_threads)


def _run_peers(peers, q: dict, turn: int, prompt, baseline, args) -> list[dict]:
    from orchestrator.requests import tokenize_prompt
    from specmesh.client import build_request

    # The orchestrator's own tokenization: the peers see exactly our prompt ids.
    prompt_ids = tokenize_prompt(build_request(prompt, chat=not args.no_chat), peers.target.tokenizer)
    rows = [{**r, "turn": turn} for r in peers.run_prompt(prompt_ids, q, baseline.token_ids, args.max_new_tokens)]
    for r in rows:
        same = {True: "same", False: "DIFFERENT", None: "-"}[r["same_as_target_only"]]
        print(f"[peer] {_label(q, turn)} {q['category']:<14} {r['config']:<14} {r['committed_tokens']:4d} tok "
              f"{r['tokens_per_second']:6.1f} tok/s  per step {r['committed_per_step']:4.2f}  {same}",
              file=sys.stderr, flush=True)
    return rows


def latency(runs: list[dict]) -> tuple[float | None, float | None]:
    """(median time to first token, time per output token after the first), in ms, as vLLM's
    benchmarks report them; None where the runs do not record a first token (the in-process peers)."""
    timed = [r for r in runs if r.get("ttft_s") is not None]
    if not timed or len(timed) < len(runs):
        return None, None
    after = sum(r["committed_tokens"] - 1 for r in timed)
    tpot = 1000 * sum(r["elapsed_s"] - r["ttft_s"] for r in timed) / after if after > 0 else None
    return 1000 * statistics.median(r["ttft_s"] for r in timed), tpot


def _all_equal(same: list[bool | None]) -> bool | None:
    """True: every compared output equalled target-only's; None: none was compared (sampled runs)."""
    compared = [x for x in same if x is not None]
    return all(compared) if compared else None


def summarize(rows: list[dict], configs: list[tuple[str, int]]) -> list[dict]:
    """Per category and overall: tokens/s of each config and its speedup over target-only, and the
    latencies users compare with other servers (time to first token, time per output token)."""
    by = defaultdict(list)
    for r in rows:
        by[(r["category"], r["config"])].append(r)
        by[("overall", r["config"])].append(r)
    categories = sorted({r["category"] for r in rows}) + ["overall"]
    summary = []
    for cat in categories:
        base = by[(cat, "target-only")]
        base_tps = sum(r["committed_tokens"] for r in base) / sum(r["elapsed_s"] for r in base)
        base_ttft, base_tpot = latency(base)
        for name in [c for c in dict.fromkeys(r["config"] for r in rows) if c != "target-only"]:
            spec = by[(cat, name)]
            tps = sum(r["committed_tokens"] for r in spec) / sum(r["elapsed_s"] for r in spec)
            drafted = sum(r["draft_tokens"] for r in spec)
            ttft, tpot = latency(spec)
            summary.append({"category": cat, "config": name, "prompts": len(spec),
                            "target_only_tokens_per_second": base_tps, "tokens_per_second": tps,
                            "speedup": tps / base_tps,
                            "target_only_ttft_p50_ms": base_ttft, "target_only_tpot_ms": base_tpot,
                            "ttft_p50_ms": ttft, "tpot_ms": tpot,
                            "acceptance_rate": sum(r["accepted_tokens"] for r in spec) / drafted if drafted else 0.0,
                            "committed_per_step": sum(r["committed_tokens"] for r in spec)
                            / max(1, sum(r["steps"] for r in spec)),
                            "outputs_equal_target_only": _all_equal([r["same_as_target_only"] for r in spec])})
    return summary


def report(rows: list[dict], configs: list[tuple[str, int]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows, configs)
    (out / "results.json").write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    # Columns as wide as their longest entry: a question file of your own may name longer categories.
    cw = max([15] + [len(s["category"]) + 2 for s in summary])
    fw = max([17] + [len(s["config"]) + 2 for s in summary])
    header = (f"{'category':<{cw}}{'config':<{fw}}{'prompts':>8}{'base tok/s':>11}{'spec tok/s':>11}{'speedup':>9}"
              f"{'accept':>8}{'tok/step':>9}{'ttft ms':>9}{'tpot ms':>9}  same output")
    print(header)
    print("-" * len(header))
    category = None
    for s in summary:
        if s["category"] != category:   # the category's target-only row first: its tok/s and latencies
            category = s["category"]
            print(f"{category:<{cw}}{'target-only':<{fw}}{'':>8}{'':>11}{s['target_only_tokens_per_second']:>11.1f}"
                  f"{1:>8.2f}x{'':>8}{1:>9.2f}{_ms(s['target_only_ttft_p50_ms'])}{_ms(s['target_only_tpot_ms'])}")
        print(f"{s['category']:<{cw}}{s['config']:<{fw}}{s['prompts']:>8}{s['target_only_tokens_per_second']:>11.1f}"
              f"{s['tokens_per_second']:>11.1f}{s['speedup']:>8.2f}x{s['acceptance_rate']:>8.2f}"
              f"{s['committed_per_step']:>9.2f}{_ms(s['ttft_p50_ms'])}{_ms(s['tpot_ms'])}  "
              f"{ {True: 'yes', False: 'NO', None: '- (sampled)'}[s['outputs_equal_target_only']]}")
    for line in bench_peers.comparison_lines(summary):
        print(line)
    plot(summary, out / "speedup.png")
    print(f"\nwrote {out / 'results.json'}, {out / 'results.csv'}, {out / 'speedup.png'}")


def _ms(value: float | None) -> str:
    return f"{value:>9.1f}" if value is not None else f"{'-':>9}"


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(s["category"] for s in summary))
    configs = list(dict.fromkeys(s["config"] for s in summary))
    width = 0.8 / len(configs)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.1 * len(categories) * 2), 4.5))
    for i, config in enumerate(configs):
        xs = [j + i * width for j in range(len(categories))]
        values = {s["category"]: s for s in summary if s["config"] == config}
        ax1.bar(xs, [values[c]["speedup"] for c in categories], width, label=config)
        ax2.bar(xs, [values[c]["committed_per_step"] for c in categories], width, label=config)
    for ax, title in ((ax1, "speedup over target-only (same run)"), (ax2, "mean committed tokens per step")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(categories))], categories, rotation=45, ha="right")
        ax.set_title(title)
        ax.axhline(1.0, color="grey", lw=0.8)
    # One legend beside the plots: with the peers there are too many bars to leave room inside.
    ax2.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
