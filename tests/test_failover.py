"""Losing a replica mid-session changes nothing in the output: the handle in
Redis is repaired by re-prefilling on a live replica. Also: a draft whose
vocabulary differs from the target's is refused at start-up."""
from __future__ import annotations

import asyncio
import signal

import pytest

from orchestrator.sessions import SessionStore
from specmesh.client import Client, build_request
from specmesh_cli.launcher import Cluster
from specmesh_cli.ports import free_port

pytestmark = pytest.mark.slow   # long: handed to a worker first (tests/conftest.py)


@pytest.fixture(scope="module")
def replicated(tiny_models, redis_url, tmp_path_factory):
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["draft"]), port=free_port(),
                      redis_url=redis_url, draft_replicas=2, verifier_replicas=2,
                      log_dir=tmp_path_factory.mktemp("logs-replicated"), startup_timeout_s=600)
    with cluster:
        yield cluster


def _record(redis_url, session_id):
    async def read():
        store = SessionStore.from_url(redis_url, 60)
        try:
            return await store.get(session_id)
        finally:
            await store.client.aclose()

    return asyncio.run(read())


def _handles(redis_url, session_id):
    record = _record(redis_url, session_id)
    return record.draft_handle.replica, record.verifier_handle.replica


@pytest.mark.parametrize("kill", [signal.SIGKILL, signal.SIGTERM], ids=["crash", "graceful"])
def test_replica_loss_mid_stream_keeps_the_output(replicated, redis_url, kill):
    prompt = "the cat sat on the mat. the cat sat on the"
    options = dict(max_new_tokens=120, temperature=1.0, top_p=0.9, seed=99, k=3, drafter="model")
    with Client(replicated.address) as client:
        reference = client.generate(prompt, **options)
        session_id = f"failover-{kill.name}"
        stream = client.stream(build_request(prompt, session_id=session_id, **options))
        chunks = [next(stream) for _ in range(4)]
        draft_addr, verifier_addr = _handles(redis_url, session_id)
        victims = [f"verifier-{replicated.verifier_ports.index(int(verifier_addr.rsplit(':', 1)[1]))}",
                   f"draft-{replicated.draft_ports.index(int(draft_addr.rsplit(':', 1)[1]))}"]
        for victim in victims:
            replicated.stop_tier(victim, sig=kill)
        chunks += list(stream)
        try:
            tokens = [t for c in chunks for t in c.token_ids]
            assert chunks[-1].finish_reason in ("length", "stop")
            assert tokens == reference.token_ids
            # The survivors served the rest of the session.
            assert len(tokens) > sum(len(c.token_ids) for c in chunks[:4])
        finally:
            for victim in victims:
                replicated.start_tier(victim)
            replicated.wait()
        after = client.generate(prompt, **options)
        assert after.token_ids == reference.token_ids


def test_draft_with_another_vocabulary_is_refused(tiny_models, redis_url, tmp_path):
    cluster = Cluster(model=str(tiny_models["target"]), draft_model=str(tiny_models["other_vocab"]),
                      port=free_port(), redis_url=redis_url, log_dir=tmp_path, startup_timeout_s=300)
    with pytest.raises(RuntimeError, match="orchestrator service exited"):
        cluster.start()
    text = (tmp_path / "orchestrator.log").read_text()
    assert "does not share the target's vocabulary" in text
    assert str(tiny_models["other_vocab"]) in text
