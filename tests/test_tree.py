"""Draft trees (specmesh.tree): the walk samples exactly from the target, and the target reads a tree
as it would read each of its paths.

1. The rule: a loop built from score_tree and accept_tree, over the Markov tables of
   test_distribution, gives the target's joint distribution (chi-square), follows the
   argmax when greedy, and the test catches two plausible wrong rules.
2. The target: a tree's logits at every node equal those of its path fed as a chain; the
   next sync keeps the accepted path's cache entries, and what follows equals a fresh feed;
   a tree batched with other sessions equals the tree alone.
3. The layout and bad input: masks, positions, and INVALID_ARGUMENT for parents that are not a tree.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from specmesh import tree
from specmesh.errors import InvalidArgument
from specmesh.kv import KVSession
from specmesh.models import load_model
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams, Stream, process_logits, sample, uniform
from specmesh.speculative import TreeAcceptance, TreeScores, accept_tree, score_tree
from tests.test_distribution import ALPHA, DRAFT_LOGITS, GEN, PROMPT, TARGET_LOGITS, V, _chi2_pvalue
from verifier_service.batching import batched_forward

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

N_SEEDS = 10_000
BRANCH = 2


# ---------------------------------------------------------------- 1. the rule


def _grow(Q: torch.Tensor, ctx: int) -> tuple[list[int], list[int]]:
    """A depth-2 tree after `ctx`: the draft's top-2 tokens, and the top-2 after each (6 nodes), depth first."""
    tokens, parents = [], []
    for first in Q[ctx].topk(BRANCH).indices.tolist():
        tokens.append(first)
        parents.append(-1)
        here = len(tokens) - 1
        for second in Q[first].topk(BRANCH).indices.tolist():
            tokens.append(second)
            parents.append(here)
    return tokens, parents


def _generate(seed: int, P: torch.Tensor, Q: torch.Tensor, score=score_tree, walk=accept_tree, depths=None):
    seq = [PROMPT]
    while len(seq) < 1 + GEN:
        start = len(seq)
        tokens, parents = _grow(Q, seq[-1])
        rows = P[[seq[-1]] + tokens]                      # Markov: node i's next-token row is P[token_i]
        result = walk(tokens, parents, score(rows, tokens, parents, seed, start), seed, start)
        if depths is not None:
            depths[result.accepted] += 1
        seq += result.tokens
    return tuple(seq[1:1 + GEN])


def _run(params: SamplingParams, **kw) -> tuple[float, list[int]]:
    P, Q = process_logits(TARGET_LOGITS, params), torch.softmax(DRAFT_LOGITS, dim=-1)
    counts = torch.zeros(V, V, V)
    depths = [0, 0, 0]
    for seed in range(N_SEEDS):
        counts[_generate(seed, P, Q, depths=depths, **kw)] += 1
    Pd = P.double()
    exact = Pd[PROMPT][:, None, None] * Pd[:, :, None] * Pd[None, :, :]
    return _chi2_pvalue(counts, N_SEEDS * exact), depths


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)],
                         ids=["t1", "t0.7_topk3"])
def test_the_tree_walk_samples_the_target(params):
    p, depths = _run(params)
    print(f"p={p:.4g} accepted-depth histogram={depths}")
    assert all(d > 50 for d in depths), depths      # ended at the root, at depth 1 and at a leaf
    assert p > ALPHA


def test_greedy_follows_the_target_argmax():
    P, Q = process_logits(TARGET_LOGITS, SamplingParams()), torch.softmax(DRAFT_LOGITS, dim=-1)
    chain, t = [], PROMPT
    for _ in range(GEN):
        t = int(TARGET_LOGITS[t].argmax())
        chain.append(t)
    for seed in range(20):
        assert list(_generate(seed, P, Q)) == chain


def _accept_one_draw_per_position(tokens, parents, scores: TreeScores, seed, start) -> TreeAcceptance:
    """Bug: every sibling is tested against the same uniform."""
    kids, path, node = tree.children(parents), [], -1
    while True:
        u, removed, chosen = uniform(seed, start + len(path), Stream.ACCEPT), 0.0, None
        for child in kids[node + 1]:
            if u < scores.target_probs[child] / (1.0 - removed):
                chosen = child
                break
            removed += scores.target_probs[child]
        if chosen is None:
            return TreeAcceptance(len(path), [tokens[i] for i in path] + [scores.end_tokens[node + 1]], False, path)
        path.append(chosen)
        node = chosen


def _score_end_tokens_from_p(rows, tokens, parents, seed, start) -> TreeScores:
    """Bug: the end token is drawn from p without taking the rejected children out."""
    scores = score_tree(rows, tokens, parents, seed, start)
    depth = tree.depths(parents)
    ends = [sample(rows[r], uniform(seed, start + (depth[r - 1] + 1 if r else 0), Stream.TARGET))
            for r in range(len(tokens) + 1)]
    return dataclasses.replace(scores, end_tokens=ends)


@pytest.mark.parametrize("bug", ["one_draw_per_position", "end_tokens_from_p"])
def test_a_wrong_tree_rule_is_detected(bug):
    kw = {"walk": _accept_one_draw_per_position} if bug == "one_draw_per_position" \
        else {"score": _score_end_tokens_from_p}
    p, _ = _run(SamplingParams(temperature=1.0), **kw)
    print(f"{bug}: p={p:.4g}")
    assert p < ALPHA


def test_greedy_end_tokens_skip_the_draws_and_give_what_they_give():
    """score_tree(greedy=True) takes each row's hot token instead of drawing from the row with its children
    taken out: the same end tokens and target probabilities, also where a child holds the hot token, and
    process_logits' greedy rows are the one-hot they always were."""

    g = torch.Generator().manual_seed(0)
    parents = [-1, 0, 1, 0, -1, 4]
    checked = hot_child = 0
    for trial in range(200):
        logits = torch.randn(len(parents) + 1, 64, generator=g)
        probs = process_logits(logits, SamplingParams())
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 64).float())
        top = logits.argmax(-1).tolist()
        # Some trials put a row's hot token among that row's children (a drafted token the target agrees with).
        tokens = [top[parent + 1] if trial % 2 and i % 2 else int(torch.randint(64, (1,), generator=g))
                  for i, parent in enumerate(parents)]
        hot_child += any(top[parent + 1] == token for parent, token in zip(parents, tokens))
        fast = score_tree(probs, tokens, parents, trial, 40, greedy=True)
        assert fast == score_tree(probs, tokens, parents, trial, 40)
        checked += 1
    assert checked == 200 and hot_child >= 50


# ---------------------------------------------------------------- 2. the target reads a tree


CONTEXT = [5, 9, 2, 7, 3, 11, 4]
NODES = [12, 13, 14, 15, 16, 17]
PARENTS = [-1, 0, 1, 0, -1, 4]       # 12 -> 13 -> 14, 12 -> 15, 16 -> 17


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(str(tiny_models["target"])).model


def _chain_logits(model, tokens) -> torch.Tensor:
    """[len(tokens), V] logits of a fresh one-pass feed: the reference every tree row must equal."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0].float()


def _session(model, tokens) -> KVSession:
    session = KVSession("s", model)
    session.sync(0, tokens)
    session.forward()
    return session


def test_every_node_reads_its_own_path(target):
    session = _session(target, CONTEXT)
    rows = session.forward(NODES, parents=PARENTS)                               # [k + 1, V]
    reference = _chain_logits(target, CONTEXT)
    torch.testing.assert_close(rows[0], reference[-1], rtol=1e-4, atol=1e-4)
    for i in range(len(NODES)):
        path = [NODES[j] for j in tree.path_to(PARENTS, i)]
        expected = _chain_logits(target, CONTEXT + path)[-1]
        torch.testing.assert_close(rows[i + 1], expected, rtol=1e-4, atol=1e-4, msg=f"node {i}")
    assert session.tokens == CONTEXT + NODES[:3]           # the first chain: 12, 13, 14


@pytest.mark.parametrize("accepted", [[0, 1, 2], [0, 3], [4, 5], []], ids=["first-chain", "off-chain",
                                                                            "second-root-child", "none"])
def test_the_next_sync_keeps_the_accepted_path(target, accepted):
    session = _session(target, CONTEXT)
    session.forward(NODES, parents=PARENTS)
    path = [NODES[j] for j in accepted]
    on_chain = next((j for j, node in enumerate(accepted) if node != j), len(accepted))
    start = len(CONTEXT) + on_chain                        # what the orchestrator names as cached
    end = 20                                               # the end token the walk committed
    session.sync(start, path[on_chain:] + [end])
    assert session.cached_len == len(CONTEXT) + len(accepted)     # the path's entries were kept, nothing more
    rows = session.forward([21, 22])
    expected = _chain_logits(target, CONTEXT + path + [end, 21, 22])[-3:]
    torch.testing.assert_close(rows, expected, rtol=1e-4, atol=1e-4)


def test_a_sync_that_leaves_the_tree_drops_it(target):
    session = _session(target, CONTEXT)
    session.forward(NODES, parents=PARENTS)
    session.sync(len(CONTEXT) - 2, [30, 31])               # a rollback below the tree (another stream's step)
    assert session.cached_len == len(CONTEXT) - 2
    torch.testing.assert_close(session.forward([32]), _chain_logits(target, CONTEXT[:-2] + [30, 31, 32])[-2:],
                               rtol=1e-4, atol=1e-4)


def test_a_batched_tree_equals_the_tree_alone(target):
    alone = _session(target, CONTEXT)
    expected = alone.forward(NODES, parents=PARENTS)
    tree_session, chain_session = _session(target, CONTEXT), _session(target, [3, 1, 4, 1, 5])
    rows = batched_forward(target, [chain_session, tree_session], [[9, 2], NODES], parents=[None, PARENTS])
    torch.testing.assert_close(rows[1], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[0], _chain_logits(target, [3, 1, 4, 1, 5, 9, 2])[-3:], rtol=1e-4, atol=1e-4)
    assert tree_session.tokens == alone.tokens and tree_session.pending_tree == alone.pending_tree


# ---------------------------------------------------------------- 3. layout and bad input


def test_the_layout_of_a_tree():
    offsets, allowed = tree.feed_layout(2, PARENTS)
    assert offsets.tolist() == [0, 1, 2, 3, 4, 3, 2, 3]
    # node 2 (14) sees the tail, 12, 13 and itself; node 5 (17) the tail, 16 and itself
    assert allowed[2 + 2].tolist() == [True, True, True, True, True, False, False, False]
    assert allowed[2 + 5].tolist() == [True, True, False, False, False, False, True, True]
    assert allowed[1].tolist() == [True, True] + [False] * 6
    assert tree.first_chain(PARENTS) == 3 and tree.is_chain([-1, 0, 1]) and not tree.is_chain(PARENTS)
    assert tree.children(PARENTS)[0] == [0, 4] and tree.path_to(PARENTS, 5) == [4, 5]


@pytest.mark.parametrize("parents", [[0, 0], [-1, 1], [-2, 0], [-1]], ids=["self", "forward", "below-root",
                                                                           "too-few"])
def test_parents_that_are_not_a_tree_are_invalid_argument(parents):
    with pytest.raises(InvalidArgument, match="parents"):
        tree.check_parents(parents, 2)


def test_the_verifier_refuses_a_bad_tree_and_keeps_the_session(tiny_models):
    from specmesh.config import VerifierConfig
    from specmesh.models import load_model as load
    from verifier_service.engine import TargetEngine, VerifyCall

    engine = TargetEngine(load(str(tiny_models["target"])), VerifierConfig())
    engine.prefill("t", CONTEXT)
    proposals = [DraftProposal.point_mass(t) for t in NODES[:2]]
    bad = VerifyCall("t", len(CONTEXT), [], proposals, SamplingParams(), 0, parents=[1, -1])
    assert isinstance(engine.verify_batch([bad])[0], InvalidArgument)
    good = VerifyCall("t", len(CONTEXT), [], proposals, SamplingParams(), 0, parents=[-1, -1])
    verified = engine.verify_batch([good])[0]
    assert isinstance(verified.scores, TreeScores) and len(verified.scores.end_tokens) == 3


def test_the_orchestrator_keeps_the_features_of_the_accepted_path():
    from orchestrator.decode import _path_rows

    rows = b"".join(bytes([i]) * 4 for i in range(2 + len(NODES)))     # 2 fed committed tokens, then 6 nodes
    kept = _path_rows(rows, 4, len(NODES), [0, 3])                         # the path 12 -> 15
    assert kept == bytes([0]) * 4 + bytes([1]) * 4 + bytes([2]) * 4 + bytes([5]) * 4

