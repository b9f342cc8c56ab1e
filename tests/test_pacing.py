"""Draft pacing (orchestrator.pacing): a session stops drafting while its drafts do not pay, looks again
after 4, 8, ... 32 plain steps, and a resumed session keeps the schedule; through the services, paced
steps draft nothing and the output stays the target's."""
from __future__ import annotations

import pytest

from orchestrator.pacing import FIRST_PAUSE, LONGEST_PAUSE, Pacer
from specmesh.client import Client, build_request
from specmesh_cli.launcher import Cluster
from specmesh_cli.redis_server import free_port
from tests.conftest import stream_through_a_kill


def schedule(pacer: Pacer, committed_when_drafted, steps: int, k: int = 5) -> str:
    """'D' for a step that drafts, '.' for a paced one; a drafted step commits what the callable says."""
    out = []
    for step in range(steps):
        asked = pacer.k(k)
        if asked:
            pacer.observe(asked, committed_when_drafted(step))
        out.append("D" if asked else ".")
    return "".join(out)


def test_drafts_that_pay_never_pause():
    assert schedule(Pacer(1.3), lambda step: 2, 200) == "D" * 200


def test_one_bad_step_does_not_stop_drafting_but_a_run_of_them_does():
    pacer = Pacer(1.3)
    assert schedule(pacer, lambda step: 1, 4) == "DDDD"
    assert not pacer.left
    assert schedule(pacer, lambda step: 1, 1 + FIRST_PAUSE) == "D" + "." * FIRST_PAUSE


def test_the_pause_doubles_while_looking_again_finds_no_better_then_stays_at_its_longest():
    text = schedule(Pacer(1.3), lambda step: 1, 300)
    pauses = [len(run) for run in text.strip("D").split("D") if run]
    assert pauses[:4] == [FIRST_PAUSE, 2 * FIRST_PAUSE, 4 * FIRST_PAUSE, 8 * FIRST_PAUSE]
    assert set(pauses[4:-1]) == {LONGEST_PAUSE}


def test_a_look_that_finds_accepted_drafts_resumes_drafting():
    pacer = Pacer(1.3)
    schedule(pacer, lambda step: 1, 1 + 5)     # paused
    assert pacer.left
    schedule(pacer, lambda step: 1, pacer.left)
    assert schedule(pacer, lambda step: 4, 10) == "D" * 10


def test_no_cost_means_every_step_drafts():
    for cost in (0.0, 1.0):
        assert schedule(Pacer(cost), lambda step: 1, 100) == "D" * 100


def test_target_only_and_the_last_token_are_left_alone():
    pacer = Pacer(1.3)
    schedule(pacer, lambda step: 1, 6)
    left = pacer.left
    assert pacer.k(0) == 0 and pacer.left == left     # asking for no drafts spends no paused step


def test_the_kept_state_restores_the_schedule_to_the_bit():
    a = Pacer(1.3)
    schedule(a, lambda step: 1 + step % 3 // 2, 37)
    b = Pacer.restore(1.3, a.state())
    rule = lambda step: 1 + (step * 7) % 5 // 3
    assert schedule(a, rule, 200) == schedule(b, rule, 200)
    assert (a.mean, a.pause, a.left) == (b.mean, b.pause, b.left)


@pytest.mark.parametrize("kept", ["", "garbage", "1.5 4"])
def test_a_record_without_a_schedule_starts_a_fresh_one(kept):
    assert Pacer.restore(1.3, kept) == Pacer(1.3)


@pytest.fixture(scope="module")
def paced(tiny_models, redis_url, tmp_path_factory):
    """The tiny pair, paced at a cost no draft pays, behind two orchestrators (one to kill)."""
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, log_dir=tmp_path_factory.mktemp("logs-paced"), startup_timeout_s=900,
                      orchestrator_replicas=2, extra_env={"SPECMESH_DRAFT_STEP_COST": "100"})
    with cluster:
        yield cluster


REQUEST = dict(max_new_tokens=80, k=3, drafter="model")


def test_paced_steps_draft_nothing_as_the_schedule_says_and_change_no_token(paced):
    with Client(f"localhost:{paced.orchestrator_ports[0]}") as client:
        chunks = [c for c in client.stream(build_request("pace me", **REQUEST)) if c.token_ids]
        target_only = client.generate("pace me", max_new_tokens=80, k=0)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == target_only.token_ids
    # Replay the schedule from what each step committed: the services drafted exactly where it says.
    pacer, generated, expected = Pacer(100.0), 0, []
    for chunk in chunks:
        asked = pacer.k(min(REQUEST["k"], REQUEST["max_new_tokens"] - generated - 1))
        expected.append(asked > 0)
        if asked:
            pacer.observe(chunk.step.draft_tokens, chunk.step.accepted_tokens + 1)
        generated += len(chunk.token_ids)
    drafted = [c.step.draft_tokens > 0 for c in chunks]
    assert drafted == expected
    assert drafted[:2] == [True, False] and drafted.count(True) < len(drafted) / 4


@pytest.mark.parametrize("temperature, seed", [(0.9, 21), (1.0, 22)])
def test_a_resumed_session_drafts_where_the_stream_would_have(paced, temperature, seed):
    """Sampled tokens depend on what was drafted where: the kept schedule makes the resume token for token."""
    with Client(f"localhost:{paced.orchestrator_ports[1]}") as client:
        reference = client.generate("resume my pace", temperature=temperature, seed=seed, **REQUEST)
    tokens = stream_through_a_kill(paced, build_request("resume my pace", temperature=temperature, seed=seed,
                                                        **REQUEST), after_tokens=12)
    assert tokens == reference.token_ids
