"""Per-token cost and acceptance of a draft model in fp32 and int8.

    PYTHONPATH=$PWD python tools/draft_quant.py --draft PATH [--threads 1]

Cost: one draft token (a 1-token KV-cached forward, output head for the last
position only, what ModelDrafter.propose does per token) after a ~400-token
context, each variant in turn, round by round, median.

Acceptance: the target's greedy continuations of a few prompts written here
(not Spec-Bench), then each draft teacher-forced over them: greedy committed
tokens per step at k (the draft's proposals match the target's until the
first miss, as in a real greedy run), and at temperature 1 the expected
acceptance sum_x min(p(x), q(x)) per position.
"""
from __future__ import annotations

import argparse
import statistics
import time

from pathlib import Path

import torch

from specmesh_cli import bench_peers
from specmesh.kv import KVSession
from specmesh.models import load_model
from specmesh.quantize import quantize_linears

PROMPTS = [
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a list and a tuple in Python? Give examples.",
    "Summarize the causes of the French Revolution in a few paragraphs.",
    "A train travels 120 km in 1.5 hours. What is its average speed? Explain your reasoning.",
    "Give me five tips for staying focused while working from home.",
]


def committed_per_step(match: list[bool], k: int) -> float:
    """Greedy speculative steps over one continuation: each commits the matched run (<= k) plus one."""
    pos, steps = 0, 0
    while pos < len(match):
        run = 0
        while run < k and pos + run < len(match) and match[pos + run]:
            run += 1
        pos += run + 1
        steps += 1
    return len(match) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", required=True)
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--methods", default="none,int8-dynamic")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    target = load_model(args.target)
    drafts = {}
    for method in args.methods.split(","):
        if (Path(args.draft) / bench_peers.VOCAB_MAP_FILE).is_file():   # a distilled (reduced-vocabulary) draft
            model = bench_peers.full_vocab_assistant(Path(args.draft), target.info).model
        else:
            model = load_model(args.draft).model
        started = time.monotonic()
        quantize_linears(model, method)
        print(f"{method}: quantized in {time.monotonic() - started:.2f} s")
        drafts[method] = model

    # --- cost per draft token
    ctx = torch.randint(0, target.info.vocab_size, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    sessions = {}
    for name, model in drafts.items():
        s = KVSession(name, model)
        s.sync(0, ctx)
        s.forward(last_only=True)
        sessions[name] = s
    times = {name: [] for name in drafts}
    for r in range(args.rounds + 3):
        for name, s in sessions.items():
            s.sync(len(ctx), [])
            began = time.perf_counter()
            s.forward([ctx[r % 50]], last_only=True)
            if r >= 3:
                times[name].append(time.perf_counter() - began)
    base = statistics.median(times[next(iter(drafts))])
    for name in drafts:
        m = statistics.median(times[name])
        print(f"cost per draft token  {name:<13} {m * 1e3:6.2f} ms  ({m / base:.2f}x of {next(iter(drafts))})")

    # --- acceptance on the target's own greedy continuations
    tok = target.tokenizer
    greedy = {name: [] for name in drafts}
    overlap = {name: [] for name in drafts}
    agree_fp32 = {name: [] for name in drafts}
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids          # [1, P]
        with torch.inference_mode():
            out = target.model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)   # [1, P + N]
            n_prompt = ids.shape[1]
            gen = out[0, n_prompt:]                                                         # [N]
            p = torch.softmax(target.model(out).logits[0, n_prompt - 1:-1].float(), -1)     # [N, V]
            ref = None
            for name, model in drafts.items():
                q_logits = model(out).logits[0, n_prompt - 1:-1].float()                    # [N, V]
                q = torch.softmax(q_logits, -1)
                greedy[name].append(committed_per_step((q_logits.argmax(-1) == gen).tolist(), args.k))
                overlap[name].append(torch.minimum(p, q).sum(-1).mean().item())
                ref = q_logits.argmax(-1) if ref is None else ref
                agree_fp32[name].append((q_logits.argmax(-1) == ref).float().mean().item())
        print(f"  prompt done: {prompt[:40]!r} ({len(gen)} tokens)", flush=True)
    print(f"\nacceptance over {len(PROMPTS)} prompts x {args.new_tokens} target tokens, k = {args.k}")
    for name in drafts:
        print(f"  {name:<13} greedy committed/step {statistics.mean(greedy[name]):.3f}   "
              f"E[accept] at T=1 {statistics.mean(overlap[name]):.3f}   "
              f"argmax equal to {next(iter(drafts))} {statistics.mean(agree_fp32[name]):.3f}")


if __name__ == "__main__":
    main()
