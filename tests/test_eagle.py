"""The `eagle` drafter: a draft that reads the target's features, served through the three services.

The features travel verifier -> orchestrator -> draft (specmesh.eagle). What is
proved here: the verifier's features are the target's; the drafter recomputes
accepted draft positions from the real features, so incremental syncs propose
exactly what a from-scratch feed proposes; greedy output is the target's, also
when a draft replica is killed or another orchestrator resumes the stream; and
features of the wrong length are refused.
"""
from __future__ import annotations

import signal

import grpc
import pytest
import torch

import specmesh.kv
from distill.draft_model import build_eagle
from draft_service.drafters.eagle import EagleDrafter
from specmesh.client import Client, build_request
from specmesh.config import VerifierConfig
from specmesh import tree, wire
from specmesh.distilled import VocabMap, mask_other, save_draft
from specmesh.eagle import features_from_bytes, grow_tree, load_eagle, save_fc
from specmesh.fast_linear import apply_kernels
from specmesh.models import load_model
from specmesh.proposal import DraftProposal
from specmesh.sampling import SamplingParams
from specmesh.v1 import cache_pb2, draft_pb2, draft_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port
from tests.conftest import stream_through_a_kill
from tests.test_failover import _handles, _record
from orchestrator.decode import _request_from_record
from orchestrator.tree_cut import pooled, tree_min_confidence
from verifier_service.engine import TargetEngine, VerifyCall

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)

PROMPTS = ["the cat sat on the mat. the cat", "hello world, said the", "once upon a time", "1, 2, 3, 4,"]
GREEDY = dict(max_new_tokens=60, temperature=0.0)


@pytest.fixture(scope="module")
def eagle(tiny_models, tmp_path_factory):
    """The tiny target and an EAGLE draft folder built from it (over most of its vocabulary)."""
    target = load_model(str(tiny_models["target"]))
    info = target.info
    subset = tuple(range(1, info.vocab_size - 4))
    model = build_eagle(target.model, subset, layers=1)
    folder = tmp_path_factory.mktemp("eagle") / "draft"
    save_draft(folder, model.lm, VocabMap(info.name, info.vocab_size, info.vocab_fingerprint, subset,
                                          info.eos_token_ids, info.max_context), card="# test eagle\n")
    save_fc(folder, model)
    return target, folder


@pytest.fixture(scope="module")
def cluster(tiny_models, eagle, redis_url, tmp_path_factory):
    # Full trees: the tiny random draft is rarely sure of anything, and a tree cut by confidence (the CPU
    # default of `specmesh up`) would seldom draft (test_a_tree_cut_by_confidence_... restarts it cut).
    cluster = Cluster(model=str(tiny_models["target"]), eagle_model=str(eagle[1]), port=free_port(),
                      redis_url=redis_url, draft_replicas=2, orchestrator_replicas=2,
                      log_dir=tmp_path_factory.mktemp("logs-eagle"), startup_timeout_s=900,
                      extra_env={"SPECMESH_TREE_MIN_CONFIDENCE": "0"})
    with cluster:
        yield cluster


def features_of(target, tokens) -> torch.Tensor:
    """[n, H] what the target's LM head reads at each position."""
    with torch.no_grad():
        return target.model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0].float()


def before(features: torch.Tensor) -> torch.Tensor:
    """[n, H] features -> the feature before each position (zeros first), fp16 like the wire."""
    return torch.cat([torch.zeros(1, features.shape[1]), features[:-1]]).half().float()


# ---------------------------------------------------------------- 1. the drafter alone


def test_incremental_syncs_propose_what_a_fresh_feed_proposes(eagle):
    """Accepted draft positions are fed again with the target's real features: after any sequence of
    syncs the proposals equal those of a state fed everything at once."""
    target, folder = eagle
    drafter = EagleDrafter(load_eagle(str(folder), target=target.info))
    tokens = target.tokenizer.encode("the quick brown fox jumps over the lazy dog, again and again")
    feats = before(features_of(target, tokens))                                      # [n, H]
    params, seed, k = SamplingParams(temperature=0.8), 7, 4
    state = drafter.new_state("s")
    start = 10
    state.sync(0, tokens[:start], features=feats[:start])
    drafter.propose(state, k, params, seed, top_n=8)
    # Steps that accept 2, 0, 4 and 1 draft positions (their tokens are the text's, accepted or not).
    for accepted in (2, 0, 4, 1, 3):
        end = start + accepted + 1
        state.sync(start, tokens[start:end], None, features=feats[start:end])
        got = drafter.propose(state, k, params, seed, top_n=8)
        fresh = drafter.new_state("fresh")
        fresh.sync(0, tokens[:end], features=feats[:end])
        want = drafter.propose(fresh, k, params, seed, top_n=8)
        assert [p.token_id for p in got] == [p.token_id for p in want]
        for a, b in zip(got, want):
            assert torch.equal(a.q_ids, b.q_ids)
            torch.testing.assert_close(a.q_probs, b.q_probs, atol=1e-5, rtol=1e-4)
        start = end
    assert state.real_len == start        # the cache holds only real-feature positions after a sync ...
    state.sync(start, [], None, features=feats[start:start])
    assert state.cache.get_seq_length() == start


def test_a_read_ahead_caches_the_prompt_and_changes_no_proposal(eagle):
    """A Propose of 0 (read) feeds the synced tokens now; the next Propose, one token later, drafts
    what a state fed everything at once drafts."""
    target, folder = eagle
    drafter = EagleDrafter(load_eagle(str(folder), target=target.info))
    tokens = target.tokenizer.encode("a prompt the draft reads while the first Verify runs, then drafts")
    feats = before(features_of(target, tokens))
    params, n = SamplingParams(), len(tokens) - 1
    state = drafter.new_state("read")
    state.sync(0, tokens[:n], features=feats[:n])
    drafter.read(state)
    assert state.real_len == n and state.cache.get_seq_length() == n
    state.sync(n, tokens[n:], None, features=feats[n:])
    fresh = drafter.new_state("fresh")
    fresh.sync(0, tokens, features=feats)
    got, want = drafter.propose(state, 4, params, 0, top_n=8), drafter.propose(fresh, 4, params, 0, top_n=8)
    assert [p.token_id for p in got] == [p.token_id for p in want]


def _rank(rows):
    """Greedy log-scores of the next draft token, as the drafter ranks tree nodes."""
    return torch.log_softmax(mask_other(rows).float(), dim=-1)


def _chain_row(drafter, tokens, feats, ids, parents, node) -> torch.Tensor:
    """The draft's output after the committed tokens and a chain fed along `node`'s path (-1: the root)."""
    chain = drafter.new_state("chain")
    chain.sync(0, tokens, features=feats)
    row, feature = chain.feed_committed()
    for step in tree.path_to(parents, node):
        row, feature = chain.feed_draft(int(drafter.draft_to_target[ids[step]]), feature)
    return row


@pytest.mark.parametrize("invariant", [False, True], ids=["stock", "batch-invariant"])
def test_a_tree_grows_each_node_from_its_own_path(eagle, invariant):
    """grow_tree feeds a layer of nodes in one pass under a tree mask: every node's children are the
    ones a chain fed along that node's path would rank first (with the served draft's kernels too)."""
    target, folder = eagle
    drafter = EagleDrafter(load_eagle(str(folder), target=target.info), tree_branch=2)
    if invariant:
        apply_kernels(drafter.model, "packed", True)
    tokens = target.tokenizer.encode("the quick brown fox jumps over")
    feats = before(features_of(target, tokens))
    state = drafter.new_state("tree")
    state.sync(0, tokens, features=feats)
    logits, hidden = state.feed_committed()
    ids, parents = grow_tree(drafter.model, state.cache, len(tokens), logits, hidden, size=100, depth=3, branch=2,
                             rank=_rank)
    assert state.cache.get_seq_length() == len(tokens)      # the tree's entries are gone again
    kids = tree.children(parents)
    grown = [i for i in range(len(ids)) if kids[i + 1]]
    assert len(ids) == 2 + 4 + 4 and len(grown) == 4        # 2 children of the root; the best 2 of each layer grow
    for node in [-1] + grown:
        row = _chain_row(drafter, tokens, feats, ids, parents, node)
        assert sorted(ids[c] for c in kids[node + 1]) == sorted(_rank(row[None])[0].topk(2).indices.tolist()), node


def _path_scores(drafter, tokens, feats, ids, parents) -> list[float]:
    """Each node's path log-chance, from chains fed along its parent's path (as the test above checks trees)."""
    scores: list[float] = []
    for node, parent in enumerate(parents):
        row = _chain_row(drafter, tokens, feats, ids, parents, parent)
        scores.append((scores[parent] if parent >= 0 else 0.0) + float(_rank(row[None])[0, ids[node]]))
    return scores


def _paths(ids, parents, nodes) -> set[tuple[int, ...]]:
    """The draft ids along each of `nodes`' paths: a tree's nodes, whatever their order."""
    return {tuple(ids[n] for n in tree.path_to(parents, node)) for node in nodes}


def test_a_tree_cut_by_confidence_keeps_the_paths_the_draft_gives_that_chance(eagle):
    """tree_min_confidence: a node is kept only when the draft gives its whole path that chance. The cut
    tree is the full tree's nodes that reach it; above every first token's chance it is empty, the
    drafter proposes nothing (the step verifies no drafts) and its state stays the committed tokens."""
    target, folder = eagle
    drafter = EagleDrafter(load_eagle(str(folder), target=target.info), tree_branch=2)
    tokens = target.tokenizer.encode("the quick brown fox jumps over")
    feats = before(features_of(target, tokens))

    def grown(min_score: float) -> tuple[list[int], list[int]]:
        state = drafter.new_state("cut")
        state.sync(0, tokens, features=feats)
        logits, hidden = state.feed_committed()
        ids, parents = grow_tree(drafter.model, state.cache, len(tokens), logits, hidden, size=100, depth=3,
                                 branch=2, rank=_rank, min_score=min_score)
        assert state.cache.get_seq_length() == len(tokens)
        tree.check_parents(parents, len(ids))
        return ids, parents

    def cut_paths(min_score: float) -> set[tuple[int, ...]]:
        ids, parents = grown(min_score)
        return _paths(ids, parents, range(len(ids)))

    ids, parents = grown(float("-inf"))
    full = _paths(ids, parents, range(len(ids)))
    scores = _path_scores(drafter, tokens, feats, ids, parents)
    ranked = sorted(scores)
    # A threshold in the widest gap around the middle: no node sits near it, whatever the float rounding.
    gap = max(range(len(ranked) // 4, 3 * len(ranked) // 4), key=lambda i: ranked[i + 1] - ranked[i])
    threshold = (ranked[gap] + ranked[gap + 1]) / 2
    kept = _paths(ids, parents, [node for node in range(len(ids)) if scores[node] >= threshold])
    cut = cut_paths(threshold)
    assert cut == kept and 0 < len(cut) < len(full)
    assert cut_paths(max(scores[node] for node in range(len(ids)) if parents[node] < 0) + 1e-3) == set()

    # The replica's own cut when it has one, whatever the Propose asks; else the Propose's; else none.
    for own, asked, wanted in ((None, None, 5), (0.0, None, 5), (0.999999, None, 0), (None, 0.999999, 0),
                               (None, 0.0, 5), (0.0, 0.999999, 5), (0.999999, 0.0, 0)):
        cutting = EagleDrafter(load_eagle(str(folder), target=target.info), tree_branch=2,
                               tree_min_confidence=own)
        state = cutting.new_state("drafter")
        state.sync(0, tokens, features=feats)
        assert len(cutting.propose(state, 5, SamplingParams(), 0, top_n=8, tree_min_confidence=asked)) == wanted
        assert state.tokens == tokens and state.cache.get_seq_length() == len(tokens)


def test_tree_min_confidence_must_be_a_chance_below_one():
    from specmesh.config import DraftConfig

    for bad in (-0.1, 1.0, 2.0):
        with pytest.raises(ValueError, match="tree_min_confidence"):
            DraftConfig(tree_min_confidence=bad)
    assert DraftConfig(tree_min_confidence=0.25).tree_min_confidence == 0.25
    assert DraftConfig().tree_min_confidence is None      # unset: each Propose's (the orchestrator's)


def test_specmesh_up_leaves_the_tree_cut_to_the_orchestrator():
    from specmesh_cli.launcher import shared_machine_defaults

    assert shared_machine_defaults("draft", {}) == {}
    assert "SPECMESH_TREE_MIN_CONFIDENCE" not in shared_machine_defaults("verifier", {})
    assert "SPECMESH_TORCH_THREADS" not in shared_machine_defaults("verifier", {"SPECMESH_TORCH_THREADS": "2"})


def test_the_lean_decoder_drafts_what_transformers_forward_drafts(eagle):
    """Served, the draft runs its decoder layer without transformers' forward (specmesh.lean_decoder):
    trees and chains, greedy and sampled, over incremental syncs, are what transformers' forward drafts;
    a draft on another attention keeps transformers' forward."""
    from specmesh.config import DraftConfig
    from specmesh.lean_decoder import lean_decoder

    target, folder = eagle
    assert lean_decoder(load_eagle(str(folder), target=target.info).model.lm.model) is None   # stock attention
    drafter = EagleDrafter.from_config(DraftConfig(eagle_model=str(folder)))
    lean = drafter.model.lean
    assert lean is not None
    tokens = target.tokenizer.encode("the quick brown fox jumps over the lazy dog, again and again")
    feats = before(features_of(target, tokens))
    for k, params in ((5, SamplingParams()), (5, SamplingParams(temperature=0.8)), (1, SamplingParams())):
        proposals = {}
        for name, decoder in (("lean", lean), ("transformers", None)):
            drafter.model.lean = decoder
            state, start, got = drafter.new_state(name), 8, []
            state.sync(0, tokens[:start], features=feats[:start])
            for accepted in (2, 0, 3, 1):
                end = start + accepted + 1
                state.sync(start, tokens[start:end], None, features=feats[start:end])
                got.append([(p.token_id, p.parent, p.q_ids.tolist(), p.q_probs.tolist())
                            for p in drafter.propose(state, k, params, 3, top_n=8)])
                start = end
            proposals[name] = got
        drafter.model.lean = lean
        assert proposals["lean"] == proposals["transformers"]


def test_the_drafter_proposes_a_tree_within_its_depth_or_a_chain(eagle):
    target, folder = eagle
    tokens = target.tokenizer.encode("the quick brown fox jumps over")
    feats = before(features_of(target, tokens))
    shapes = {}
    for branch, depth in ((1, 6), (2, 6), (2, 2)):
        drafter = EagleDrafter(load_eagle(str(folder), target=target.info), tree_branch=branch, tree_depth=depth)
        state = drafter.new_state("s")
        state.sync(0, tokens, features=feats)
        proposals = drafter.propose(state, 6, SamplingParams(), 0, top_n=8)
        assert len(proposals) == 6
        assert (state.tokens == tokens) == (branch > 1)                # a tree leaves the committed tokens alone
        shapes[branch, depth] = wire.parents(proposals)
    assert shapes[1, 6] == []                                          # a chain: no parents on the wire
    assert len(shapes[2, 6]) == 6 and max(tree.depths(shapes[2, 6])) <= 5   # sent as a tree, whatever its shape
    assert max(tree.depths(shapes[2, 2])) == 1 and not tree.is_chain(shapes[2, 2])   # two layers at most
    tree.check_parents(shapes[2, 6], 6)


def test_the_draft_reads_the_features(eagle):
    """Different features, different proposals: the features really reach the draft."""
    target, folder = eagle
    drafter = EagleDrafter(load_eagle(str(folder), target=target.info))
    tokens = target.tokenizer.encode("the quick brown fox")
    feats = before(features_of(target, tokens))
    real, zeros = drafter.new_state("a"), drafter.new_state("b")
    real.sync(0, tokens, features=feats)
    zeros.sync(0, tokens, features=torch.zeros_like(feats))
    a = drafter.propose(real, 1, SamplingParams(), 1, 8)[0]
    b = drafter.propose(zeros, 1, SamplingParams(), 1, 8)[0]
    assert not torch.allclose(a.q_probs, b.q_probs) or not torch.equal(a.q_ids, b.q_ids)


# ---------------------------------------------------------------- 6. the verifier's features


def test_engine_features_equal_the_targets_lone_chunked_and_batched(eagle, monkeypatch):
    target, _ = eagle
    monkeypatch.setattr(specmesh.kv, "PREFILL_CHUNK", 4)    # the prompt goes in chunks
    engine = TargetEngine(target, VerifierConfig())
    a = target.tokenizer.encode("a prompt of some length, read in chunks")
    b = target.tokenizer.encode("another one")
    n, rows = engine.prefill("a", a, features=True)
    assert rows.dtype == torch.float16     # the wire's, converted on the model thread (EngineHost.load says why)
    torch.testing.assert_close(rows.float(), features_of(target, a), atol=2e-3, rtol=2e-3)
    engine.prefill("b", b)
    point = DraftProposal.point_mass
    calls = [VerifyCall("a", len(a), [5], [point(6), point(7)], SamplingParams(), 1, None, True),
             VerifyCall("b", len(b), [8, 9], [point(6)], SamplingParams(), 1, None, True)]
    for (call, prompt), verified in zip(zip(calls, (a, b)), engine.verify_batch(calls)):   # one batched pass
        fed = prompt + list(call.tail) + [d.token_id for d in call.proposals]
        assert verified.features_start == len(prompt)
        assert verified.features.shape[0] == len(fed) - len(prompt) and verified.features.dtype == torch.float16
        torch.testing.assert_close(verified.features.float(), features_of(target, fed)[len(prompt):],
                                   atol=2e-3, rtol=2e-3)
    plain = engine.verify_batch([VerifyCall("b", len(b) + 2, [3], [point(4)], SamplingParams(), 1)])[0]
    assert plain.features is None      # not asked, not computed


def test_prefill_and_verify_return_the_targets_features_over_grpc(cluster, eagle):
    target, _ = eagle
    prompt = target.tokenizer.encode("features over the wire")
    with grpc.insecure_channel(f"localhost:{cluster.verifier_ports[0]}") as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        dim = stub.Info(cache_pb2.InfoRequest()).feature_dim
        assert dim == target.model.config.hidden_size
        reply = stub.Prefill(verifier_pb2.PrefillRequest(session_id="feat", token_ids=prompt, return_features=True))
        torch.testing.assert_close(features_from_bytes(reply.features, dim), features_of(target, prompt),
                                   atol=2e-3, rtol=2e-3)
        assert not stub.Prefill(verifier_pb2.PrefillRequest(session_id="nofeat", token_ids=prompt)).features
        drafts = [7, 8, 9]
        verified = stub.Verify(verifier_pb2.VerifyRequest(
            session_id="feat", sync=cache_pb2.CacheSync(start=len(prompt), token_ids=[5],
                                                        prefix_fingerprint=_fingerprint(prompt)),
            proposals=[draft_pb2.DraftProposal(token_id=t, q_ids=[t], q_probs=[1.0]) for t in drafts],
            return_features=True))
        fed = prompt + [5] + drafts
        assert verified.features_start == len(prompt)
        torch.testing.assert_close(features_from_bytes(verified.features, dim), features_of(target, fed)[len(prompt):],
                                   atol=2e-3, rtol=2e-3)
        for session in ("feat", "nofeat"):
            stub.Release(cache_pb2.ReleaseRequest(session_id=session))


def _fingerprint(tokens) -> int:
    from specmesh.fingerprint import PrefixFingerprints

    return PrefixFingerprints(tokens).at(len(tokens))


# ---------------------------------------------------------------- 4. bad input


def test_features_of_the_wrong_length_are_invalid_argument(cluster):
    with grpc.insecure_channel(f"localhost:{cluster.draft_ports[0]}") as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        info = {d.name: d for d in stub.Info(cache_pb2.InfoRequest()).drafters}["eagle"]
        assert info.uses_target_features and info.feature_dim > 0
        row = bytes(2 * info.feature_dim)
        for features in (b"", row, row * 3, row * 2 + b"\0"):
            with pytest.raises(grpc.RpcError) as error:
                stub.Propose(draft_pb2.ProposeRequest(session_id="bad-features", sync=cache_pb2.CacheSync(
                    start=0, token_ids=[5, 6]), k=2, drafter="eagle", features=features))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "features" in error.value.details()
        ok = stub.Propose(draft_pb2.ProposeRequest(session_id="bad-features", sync=cache_pb2.CacheSync(
            start=0, token_ids=[5, 6]), k=2, drafter="eagle", features=row * 2))
        assert len(ok.proposals) == 2
        # Other drafters ignore the field, as before.
        assert stub.Propose(draft_pb2.ProposeRequest(session_id="ngram-features", sync=cache_pb2.CacheSync(
            start=0, token_ids=[5, 6, 5]), k=2, drafter="ngram")).cached_len >= 3
        for session in ("bad-features", "ngram-features"):
            stub.Release(cache_pb2.ReleaseRequest(session_id=session))


# ---------------------------------------------------------------- 2, 3, 5. through the services


@pytest.mark.parametrize("drafter", ["eagle", "eagle-hybrid"])
def test_greedy_output_is_the_targets(cluster, drafter):
    accepted = 0
    with Client(cluster.address) as client:
        for prompt in PROMPTS:
            reference = client.generate(prompt, k=0, **GREEDY)
            got = client.generate(prompt, k=4, drafter=drafter, **GREEDY)
            assert got.drafter == drafter
            assert got.token_ids == reference.token_ids, prompt
            assert got.stats.draft_tokens > 0
            accepted += got.stats.accepted_tokens
    assert accepted > 0      # accepted draft positions happened, so their features were re-synced


@pytest.mark.parametrize("drafter", ["eagle", "eagle-hybrid"])
def test_the_first_token_waits_for_no_draft(cluster, drafter):
    """A feature drafter's first step verifies no draft tokens while the draft reads the prompt: the
    first token comes as target-only's does, and drafting starts with the second step."""
    with Client(cluster.address) as client:
        reference = client.generate(PROMPTS[2], k=0, **GREEDY)
        chunks = [c for c in client.stream(build_request(PROMPTS[2], k=4, drafter=drafter, **GREEDY))
                  if c.token_ids]
    assert len(chunks[0].token_ids) == 1 and chunks[0].step.draft_tokens == 0
    assert chunks[1].step.draft_tokens > 0
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids


def test_each_session_drafts_with_the_cut_its_verifiers_measured_cost_gives(cluster, redis_url):
    """VerifierInfo.verify_cost: a Verify of k draft tokens next to one of none, measured at start-up. The
    orchestrator turns it into a session's tree cut (orchestrator/tree_cut.py), sends it with every
    Propose and keeps it in the session's record, which a resumed session drafts with."""
    costs = []
    for port in cluster.verifier_ports:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            info = verifier_pb2_grpc.VerifierStub(channel).Info(cache_pb2.InfoRequest(), timeout=30)
        assert len(info.verify_cost) == 9 and info.verify_cost[0] == 1.0 and min(info.verify_cost) > 0
        costs.append(list(info.verify_cost))
    with Client(cluster.address) as client:
        got = client.generate(PROMPTS[0], k=4, drafter="eagle", **GREEDY)
    record = _record(redis_url, got.session_id)
    assert record.params["tree_min_confidence"] == tree_min_confidence(pooled(costs), 4)
    assert _request_from_record(record).tree_min_confidence == record.params["tree_min_confidence"]


def test_a_propose_cut_outside_0_to_1_is_refused(cluster):
    with grpc.insecure_channel(f"localhost:{cluster.draft_ports[0]}") as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        for bad in (-0.5, 1.0):
            with pytest.raises(grpc.RpcError) as error:
                stub.Propose(draft_pb2.ProposeRequest(session_id="cut-refused", k=2, drafter="eagle",
                                                      sync=cache_pb2.CacheSync(start=0, token_ids=[1, 2]),
                                                      tree_min_confidence=bad), timeout=30)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "tree_min_confidence" in error.value.details()


def test_a_tree_cut_by_confidence_through_the_services_keeps_the_output(cluster):
    """Draft replicas whose trees come out empty (no node reaches the confidence asked): every eagle step
    that grows a tree verifies no drafts, the features still travel, and greedy output is the target's,
    for eagle and eagle-hybrid (whose lookup still proposes)."""
    drafts = [f"draft-{i}" for i in range(len(cluster.draft_ports))]

    def restart(confidence: str) -> None:
        cluster.extra_env["SPECMESH_TREE_MIN_CONFIDENCE"] = confidence
        for name in drafts:
            cluster.stop_tier(name)
            cluster.start_tier(name)
        cluster.wait()

    restart("0.999999")
    try:
        with Client(cluster.address) as client:
            for drafter in ("eagle", "eagle-hybrid"):
                for prompt in PROMPTS:
                    reference = client.generate(prompt, k=0, **GREEDY)
                    got = client.generate(prompt, k=4, drafter=drafter, **GREEDY)
                    assert got.token_ids == reference.token_ids, (drafter, prompt)
                    if drafter == "eagle":   # but a last step with room for one token: a chain, never cut
                        assert got.stats.draft_tokens <= 1 and got.stats.steps >= len(got.token_ids) - 1
    finally:
        restart("0")


def test_killing_a_draft_replica_mid_stream_keeps_the_output(cluster, redis_url):
    prompt = PROMPTS[0]
    options = dict(k=4, drafter="eagle", **{**GREEDY, "max_new_tokens": 120})
    with Client(cluster.address) as client:
        reference = client.generate(prompt, k=0, **{**GREEDY, "max_new_tokens": 120})
        stream = client.stream(build_request(prompt, session_id="eagle-kill", **options))
        chunks = [next(stream) for _ in range(4)]
        draft_addr, _ = _handles(redis_url, "eagle-kill")
        victim = f"draft-{cluster.draft_ports.index(int(draft_addr.rsplit(':', 1)[1]))}"
        cluster.stop_tier(victim, sig=signal.SIGKILL)
        try:
            chunks += list(stream)
            tokens = [t for c in chunks for t in c.token_ids]
            assert chunks[-1].finish_reason in ("length", "stop")
            assert tokens == reference.token_ids
            assert len(tokens) > sum(len(c.token_ids) for c in chunks[:4])
        finally:
            cluster.start_tier(victim)
            cluster.wait()


def test_resume_on_another_orchestrator_keeps_the_output(cluster):
    options = dict(k=3, drafter="eagle", **{**GREEDY, "max_new_tokens": 150})
    with Client(f"localhost:{cluster.orchestrator_ports[1]}") as client:
        reference = client.generate("resume me please", k=0, **{**GREEDY, "max_new_tokens": 150})
    tokens = stream_through_a_kill(cluster, build_request("resume me please", **options))
    assert tokens == reference.token_ids


@pytest.mark.parametrize("drafter", ["eagle", "eagle-hybrid"])
def test_a_sampled_session_resumed_on_another_orchestrator_keeps_its_tokens(cluster, drafter):
    """Sampled tokens depend on what was drafted at each position (a plain step samples with other
    draws): the resumed stream drafts where the uninterrupted one did. Only a session's first step
    verifies no drafts; the resumed stream's first step drafts, after the draft read the prompt."""
    options = dict(k=3, drafter=drafter, max_new_tokens=120, temperature=0.9, seed=31)
    with Client(f"localhost:{cluster.orchestrator_ports[1]}") as client:
        reference = client.generate("resume me sampled", **options)
    chunks: list = []
    assert stream_through_a_kill(cluster, build_request("resume me sampled", **options),
                                 chunks=chunks) == reference.token_ids
    steps = [c for c in chunks if c.step.bonus or c.step.recovered]     # not the replay of a resume
    assert len(steps) > 20 and steps[0].step.draft_tokens == 0
    assert all(c.step.draft_tokens > 0 for c in steps[1:-1])    # the last may have no room for drafts


def test_an_eagle_draft_for_a_target_of_another_width_is_refused(eagle, tmp_path, redis_url):
    """Same vocabulary, other hidden size: the orchestrator refuses at start-up, naming both widths."""
    from tests.tiny_models import build_tiny_model

    wider = build_tiny_model(tmp_path / "wider", seed=4, hidden_size=64)
    cluster = Cluster(model=str(wider), eagle_model=str(eagle[1]), port=free_port(), redis_url=redis_url,
                      log_dir=tmp_path, startup_timeout_s=300)
    with pytest.raises(RuntimeError, match="orchestrator service exited"):
        cluster.start()
    cluster.stop()
    text = (tmp_path / "orchestrator.log").read_text()
    assert "reads target features of width 32" in text and "width 64" in text
