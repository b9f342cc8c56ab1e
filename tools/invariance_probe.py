"""Does batch invariance hold on this machine's CPU and torch build? Op by op, then the whole model.

    PYTHONPATH=$PWD python tools/invariance_probe.py                 # default target
    PYTHONPATH=$PWD python tools/invariance_probe.py --model path/to/hf-folder --threads 2

specmesh/invariant.py rests on measured properties of oneDNN's matrix multiply
(a row's bits do not depend on how many rows, how many columns, or trailing
zeros along the reduction), and of torch's row-wise ops. They held on the
machines this was built on; a different CPU generation or torch may differ.
This prints each property, then feeds the same tokens through the model four
ways (one prefill, chunks, verify-sized steps, batched beside other sessions)
with stock packed kernels and with batch-invariant ones, and compares the
logits bit for bit. Exits 1 if the batch-invariant model is not invariant.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from specmesh import fast_linear, invariant, kv
from specmesh.kv import KVSession
from specmesh.models import load_model
from verifier_service.batching import batched_forward


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")


def _same(results) -> bool:
    first = results[0]
    return all(torch.equal(first, r) for r in results[1:])


def op_checks() -> dict[str, bool]:
    gen = torch.Generator().manual_seed(0)
    checks = {}
    for k, n in [(576, 1536), (1536, 576), (64, 700), (700, 65)]:
        w = torch.randn(n, k, generator=gen)
        x = torch.randn(40, k, generator=gen)
        checks[f"matmul K={k} N={n}: row 0 the same for M = 2..40"] = _same(
            [_onednn(x[:m], w)[0] for m in (2, 3, 5, 9, 17, 40)])
        checks[f"matmul K={k} N={n}: row 0 the same for N cut to any width >= 2"] = _same(
            [_onednn(x[:3], w[:cut])[0, :2] for cut in (2, 3, 17, n // 2, n)])
        checks[f"matmul K={k} N={n}: trailing zeros along K change nothing"] = _same(
            [_onednn(F.pad(x[:3], (0, z)), F.pad(w, (0, z)))[0] for z in (0, 1, 63, 300)])
    rows = torch.randn(600, 576, generator=gen)
    checks["RMSNorm-style row reduction: row 0 the same for any row count"] = _same(
        [(rows[:m] * torch.rsqrt(rows[:m].pow(2).mean(-1, keepdim=True) + 1e-5))[0] for m in (1, 2, 5, 600)])
    logits = torch.randn(9, 4096, generator=gen) * 3
    checks["softmax over the vocabulary: row 0 the same for any row count"] = _same(
        [torch.softmax(logits[:m], -1)[0] for m in (1, 2, 9)])
    values = torch.randn(5000, generator=gen) * 10
    checks["exp: an element's bits do not depend on where it sits"] = all(
        torch.equal(torch.exp(values[o:o + m].clone()), torch.exp(values)[o:o + m])
        for m in (1, 7, 17, 333) for o in (0, 1, 5))
    return checks


def model_checks(model, context: int, vocab: int) -> dict[str, float]:
    """Max |logit difference| against one prefill, for the other three ways of computing them."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (context + 8,), generator=gen).tolist()
    other = torch.randint(0, vocab, (context // 2,), generator=gen).tolist()
    fed = tokens[context:context + 4]

    def prefill(chunk: int | None = None) -> torch.Tensor:
        saved = kv.PREFILL_CHUNK
        kv.PREFILL_CHUNK = chunk or saved
        try:
            s = KVSession("a", model)
            s.sync(0, tokens[:context])
            return s.forward(fed)
        finally:
            kv.PREFILL_CHUNK = saved

    def steps() -> torch.Tensor:
        s = KVSession("a", model)
        s.sync(0, tokens[:context // 2])
        s.forward(last_only=True)
        n, i = context // 2, 0
        while n < context:
            size = (1, 3, 5, 9)[i % 4]
            s.forward(tokens[n:n + size])
            kept = min(1 + i % 3, context - n)
            s.sync(n, tokens[n:n + kept])
            n, i = n + kept, i + 1
        s.sync(context, [])
        return s.forward(fed)

    def batched() -> torch.Tensor:
        sessions = []
        for name, prompt in [("other", other), ("a", tokens[:context - 3])]:
            s = KVSession(name, model)
            s.sync(0, prompt)
            s.forward(last_only=True)
            sessions.append(s)
        sessions[1].sync(context - 3, tokens[context - 3:context])
        return batched_forward(model, sessions, [[1, 2, 3, 4, 5, 6], fed])[1]

    reference = prefill()
    return {way: float((compute() - reference).abs().max())
            for way, compute in [("chunked prefill (64)", lambda: prefill(64)), ("verify-sized steps", steps),
                                 ("batched with another session", batched)]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), oneDNN {torch.backends.mkldnn.is_available()}")
    ops = op_checks()
    for name, held in ops.items():
        print(f"  {'holds' if held else 'FAILS'}  {name}")
    failed = False
    for variant in ("packed", "batch-invariant"):
        loaded = load_model(args.model)
        fast_linear.pack_linears(loaded.model)
        if variant == "batch-invariant" and not invariant.make_batch_invariant(loaded.model):
            print("batch-invariant numerics do not apply to this model (see the log line above)")
            return 1
        diffs = model_checks(loaded.model, args.context, loaded.info.vocab_size)
        for way, diff in diffs.items():
            print(f"  {variant:<16} {way:<30} max |logit diff| vs one prefill: {diff:.3g}")
        failed |= variant == "batch-invariant" and any(diffs.values())
    print("batch invariance: " + ("FAILS on this machine" if failed else "holds (every difference is 0)"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
