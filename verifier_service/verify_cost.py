"""What a Verify of k draft tokens costs next to one of none, measured on the served model at start-up.

A draft token is verified in the same forward pass as the committed one, but not for free: on a CPU
each costs a share of a step (about 1.5% of one up to 5 draft tokens on a Zen 4 EPYC, 6% on an
AVX2 one), on a GPU next to nothing. The orchestrator reads the figures (VerifierInfo.verify_cost) to
decide how sure the draft must be of a tree node before it is worth verifying
(orchestrator/tree_cut.py). `python tools/verify_cost.py` measures the same thing at length, per
kernel path.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from verifier_service.engine import TargetEngine, VerifyCall

log = logging.getLogger("specmesh.verifier")

SESSION = "specmesh.verify-cost"   # a session id no caller can be using: the replica is not serving yet
MAX_K = 8                          # the draft and orchestrator tiers' default max_k
CONTEXT = 64                       # tokens before the verified ones, as after a short prompt


def measure_verify_cost(engine: TargetEngine, max_k: int = MAX_K, rounds: int = 7, context: int = CONTEXT,
                        clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """[cost of a Verify of k draft tokens / cost of one of none for k = 0..max_k]: the fastest of `rounds`
    rounds, each trying every k in turn after a first round that warms the kernels up. Run it on the
    model's thread, before the replica serves: it uses the engine as a Verify does, in a session of its own.

    The fastest, not the median: on a CPU the difference between k's is a few percent of a step, and
    whatever else runs meanwhile (a draft tier loading on the same machine) only ever adds time. On the
    default target this costs about 3 s of start-up on 2 CPU cores."""
    vocab = engine.info.vocab_size
    prompt = [(7 + 31 * i) % vocab for i in range(min(context, engine.info.max_context - max_k - 1))]
    engine.prefill(SESSION, prompt)
    seconds: list[list[float]] = [[] for _ in range(max_k + 1)]
    try:
        for round_ in range(rounds + 1):
            for k in range(max_k + 1):
                # The last prompt token again (its logits score draft 0), then k made-up draft tokens.
                drafts = [DraftProposal.point_mass((prompt[-1] + 1 + i) % vocab) for i in range(k)]
                call = VerifyCall(SESSION, len(prompt) - 1, prompt[-1:], drafts, SamplingParams(), seed=0)
                began = clock()
                [result] = engine.verify_batch([call])
                elapsed = clock() - began
                if isinstance(result, Exception):
                    raise result
                if round_:
                    seconds[k].append(elapsed)
    finally:
        engine.release(SESSION)
    base = min(seconds[0])
    cost = [min(s) / base if base > 0 else 1.0 for s in seconds]
    log.info("a Verify of k draft tokens costs, next to one of none (k = 0..%d): %s", max_k,
             " ".join(f"{c:.2f}" for c in cost))
    return cost
