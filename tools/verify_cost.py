"""Measure what a (k + 1)-token target forward costs next to a 1-token one, per kernel path.

    PYTHONPATH=$PWD python tools/verify_cost.py --threads 1 --rounds 30

Feeds T = 1, 2, 3, 5, 9 tokens after a ~400-token cached context through
specmesh.kv.KVSession (exactly what a Verify does), for the stock model, the
pre-packed one (specmesh.fast_linear) and the batch-invariant one
(specmesh.invariant, the verifier's default), interleaved round by round so a
noisy machine slows every variant alike; prints medians and ratios, and the
largest logit difference between the variants.

With --grow N the context grows N tokens a round, as a session's does, instead
of rolling back to the same length: oneDNN then meets a new attention shape
every round unless the cache pads its keys (specmesh/padded_cache.py, which
every variant on the batch-invariant attention uses; `batch-invariant-unpadded`
is the same model on transformers' own cache, to measure what padding saves).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from transformers import DynamicCache

from specmesh import fast_linear, invariant, lean_decoder
from specmesh.kv import KVSession
from specmesh.models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", default="1,2,3,5,9")
    parser.add_argument("--variants", default="stock,packed,batch-invariant",
                        help="stock, packed, packed-all, batch-invariant (as served: fused, on the lean decoder), "
                             "batch-invariant-transformers (the same on transformers' forward, as before the lean "
                             "decoder), batch-invariant-unfused (a product per linear layer and transformers' "
                             "forward, as before sibling projections were fused), batch-invariant-unpadded")
    parser.add_argument("--min-rows", default="",
                        help="comma-separated; each batch-invariant variant also runs with its thin products padded "
                             "to this many rows (`NAME@N`; specmesh.fast_linear.set_min_rows); the variant itself "
                             "pads as served (fast_linear.choose_min_rows)")
    parser.add_argument("--grow", type=int, default=0, help="tokens the context grows each round (0: fixed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]

    names = args.variants.split(",")
    min_rows = {name: 0 for name in names}           # 0: as served
    for n in filter(None, args.min_rows.split(",")):
        min_rows.update({f"{name}@{n}": int(n) for name in names if name.startswith("batch-invariant")})
    variants = {}
    for name in min_rows:
        model = load_model(args.model).model
        started = time.monotonic()
        if name.startswith("packed"):
            fast_linear.pack_linears(model)
        if name.startswith("batch-invariant"):
            invariant.make_batch_invariant(model, fuse=not name.startswith("batch-invariant-unfused"))
            if name.split("@")[0] == "batch-invariant":
                lean_decoder.use_lean_forward(model)
            if min_rows[name]:
                fast_linear.set_min_rows(model, min_rows[name])
            else:
                print(f"{name}: padded to {fast_linear.choose_min_rows(model)} rows")
        if name == "packed-all":   # oneDNN for single rows too, to show why M = 1 keeps F.linear
            for module in model.modules():
                if isinstance(module, fast_linear.PackedLinear):
                    module.in_features = -1
        print(f"{name}: set-up {time.monotonic() - started:.2f} s")
        variants[name] = model

    gen = torch.Generator().manual_seed(0)
    vocab = next(iter(variants.values())).config.vocab_size
    context = torch.randint(0, vocab, (args.context + args.grow * (args.rounds + 4),), generator=gen).tolist()
    extra = torch.randint(0, vocab, (max(sizes) - 1,), generator=gen).tolist()
    sessions, committed = {}, {}
    for name, model in variants.items():
        s = KVSession(name, model)
        if name.split("@")[0].endswith("-unpadded"):
            s.cache = DynamicCache(config=model.config)
        s.sync(0, context[:args.context])
        s.forward()
        sessions[name], committed[name] = s, args.context
    length = args.context

    def run(name: str, t: int) -> tuple[float, torch.Tensor]:
        s = sessions[name]
        # Roll back to the context (the last context token is fed again), grown to `length`.
        s.sync(committed[name], context[committed[name]:length])
        committed[name] = length
        began = time.perf_counter()
        logits = s.forward(extra[:t - 1])
        return time.perf_counter() - began, logits

    reference = {t: run(next(iter(variants)), t)[1] for t in sizes}
    for name in variants:
        for t in sizes:
            logits = run(name, t)[1]
            diff = (logits - reference[t]).abs().max().item()
            same = bool((logits.argmax(-1) == reference[t].argmax(-1)).all())
            if name != next(iter(variants)):
                print(f"{name} T={t}: max |logit diff| vs {next(iter(variants))} {diff:.2e}, argmax equal {same}")

    times = {(n, t): [] for n in variants for t in sizes}
    for _ in range(3):                 # warm-up
        length += args.grow
        for n in variants:
            for t in sizes:
                run(n, t)
    for r in range(args.rounds):
        length += args.grow
        for t in sizes:
            for n in variants:
                times[(n, t)].append(run(n, t)[0])
    base1 = statistics.median(times[(next(iter(variants)), 1)])
    grown = f", growing {args.grow} a round to {length}" if args.grow else ""
    print(f"\nthreads={args.threads} context={args.context}{grown} rounds={args.rounds} "
          "(median ms; ratio to own T=1; ratio to the first variant's T=1)")
    print(f"{'variant':<27}" + "".join(f"{'T=' + str(t):>22}" for t in sizes))
    for n in variants:
        one = statistics.median(times[(n, 1)])
        cells = []
        for t in sizes:
            m = statistics.median(times[(n, t)])
            cells.append(f"{m * 1e3:8.1f} {m / one:5.2f}x {m / base1:5.2f}x")
        print(f"{n:<26} " + "".join(f"{c:>22}" for c in cells))


if __name__ == "__main__":
    main()
