"""The cost model's terms on a GPU: t1, r (a (k+1)-token verify over a 1-token step) and c (a draft token).

    python -m tools.gpu_step_cost [--dtype bfloat16] [--context 400] [--rounds 50]   # from the repo root

Needs only torch, transformers and specmesh.models (a GPU machine's stock image), so it builds
the shapes rather than loading them: the target is a randomly initialised
model of SmolLM2-135M's configuration (timing does not depend on the weights'
values), and the draft is what an EAGLE draft of the shipped kind computes per
token: `fc` (2H -> H), one decoder layer of the target's shape and a
2,048-row head. Each forward is KV-cached after a --context-token prompt and
timed with CUDA synchronisation; the median over --rounds is printed, with the
speedup the cost model of docs/benchmarks.md projects from them.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specmesh.models import cache_kwargs

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
                    tie_word_embeddings=True, rms_norm_eps=1e-5)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, rounds: int) -> float:
    for _ in range(5):
        fn()
    samples = []
    for _ in range(rounds):
        sync()
        began = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - began)
    return statistics.median(samples)


def cached_step(model, context: int, fed: int, device):
    """-> a function that feeds `fed` tokens after a cached `context`-token prompt (the cache cropped back each time)."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, context), device=device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(model, cache))
    ids = torch.randint(0, vocab, (1, fed), device=device)

    def step():
        with torch.no_grad():
            model(input_ids=ids, **cache_kwargs(model, cache))
        cache.crop(-fed)      # drop what was fed (a negative count: both old and new transformers)
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--context", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--device", default="cuda")
    # per-step service overhead, measured through the services on the CPU (docs/distill.md, the step
    # split at T = 0.8): what target-only steps pay besides the verify, and what a speculative step adds
    parser.add_argument("--overhead-ms", type=float, default=9.7)
    parser.add_argument("--draft-overhead-ms", type=float, default=6.0)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)

    target = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device, dtype).eval()
    # sizes take turns, a round at a time, so clock ramps and other tenants slow every size alike
    sizes = sorted({1, 2, 3, 5, 9, args.k + 1})      # r is read at k + 1, whatever --k is
    steps = {fed: cached_step(target, args.context, fed, device) for fed in sizes}
    samples = {fed: [] for fed in steps}
    for _ in range(args.rounds // 10):
        for fed, step in steps.items():
            samples[fed].append(timed(step, 10))
    t = {fed: statistics.median(v) for fed, v in samples.items()}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}  target: SmolLM2-135M shapes, {args.dtype}, context {args.context}")
    for fed, secs in t.items():
        print(f"  target forward of {fed} token(s): {secs * 1e3:7.2f} ms  ({secs / t[1]:.2f}x a 1-token step)")

    draft_cfg = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": 1, "vocab_size": 2048})
    draft = LlamaForCausalLM(draft_cfg).to(device, dtype).eval()
    fc = torch.nn.Linear(2 * draft_cfg.hidden_size, draft_cfg.hidden_size, bias=False).to(device, dtype)
    prompt = torch.randint(0, 2048, (1, args.context), device=device)
    cache = DynamicCache(config=draft_cfg)
    feature = torch.randn(1, 1, draft_cfg.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        draft(input_ids=prompt, **cache_kwargs(draft, cache))

    def draft_token():
        # what an EAGLE draft does per proposed token: embed, mix with the feature, one layer, the head
        with torch.no_grad():
            tok = draft.model.embed_tokens(torch.tensor([[5]], device=device))
            mixed = fc(torch.cat([tok, feature], dim=-1))
            hidden = draft.model(inputs_embeds=mixed, **cache_kwargs(draft.model, cache)).last_hidden_state
            draft.lm_head(hidden)
        cache.crop(-1)
    c_secs = timed(draft_token, args.rounds)
    print(f"  EAGLE-shaped draft token (fc + 1 layer + 2,048-row head): {c_secs * 1e3:7.2f} ms")

    t1, r, c = t[1], t[args.k + 1] / t[1], c_secs / t[1]
    print(f"\ncost model terms at k = {args.k}: t1 = {t1 * 1e3:.2f} ms, r = {r:.2f}, c = {c:.3f} per draft token")
    o, od = args.overhead_ms * 1e-3 / t1, args.draft_overhead_ms * 1e-3 / t1
    print(f"projected speedup S = tau (1 + o) / (r + k c + o + o_d); through the services o = {o:.2f}, o_d = {od:.2f} "
          f"({args.overhead_ms} and {args.draft_overhead_ms} ms a step, as measured on the 2-core CPU):")
    for label, oo, ood in (("in-process (o = o_d = 0)", 0.0, 0.0), ("through the services", o, od)):
        cells = ", ".join(f"tau {tau}: {tau * (1 + oo) / (r + args.k * c + oo + ood):.2f}x"
                          for tau in (1.41, 1.72, 2.0, 2.5, 3.0))
        print(f"  {label}: {cells}")


if __name__ == "__main__":
    main()
