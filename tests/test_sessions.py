"""Sessions live in a real Redis: present with their handles while streaming,
gone after release or TTL; updates are atomic; Cancel works across the API."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis as redis_sync

from orchestrator.sessions import Handle, SessionStore
from specmesh.client import build_request


def test_record_in_redis_during_stream_and_kept_as_finished_after(tiny_cluster, tiny_client, redis_url):
    stream = tiny_client.stream(build_request("hello hello hello world", max_new_tokens=60, k=3, drafter="model",
                                              session_id="live-1"))
    next(stream)
    for _ in range(3):
        next(stream)

    async def read():
        store = SessionStore.from_url(redis_url, 60)
        try:
            return await store.get("live-1")
        finally:
            await store.client.aclose()

    record = asyncio.run(read())
    assert record is not None and record.status == "running"
    assert record.prompt_len == len("hello hello hello world")
    assert len(record.tokens) > record.prompt_len and record.step >= 3
    assert record.verifier_handle.replica == f"localhost:{tiny_cluster.verifier_port}"
    assert record.draft_handle.replica == f"localhost:{tiny_cluster.draft_port}"
    assert record.verifier_handle.cache_id == "live-1"
    assert 0 < record.verifier_handle.cached_len <= len(record.tokens)
    assert record.params["k"] == 3 and record.params["drafter"] == "model"
    assert 0 < record.ttl_s <= 3600
    rest = list(stream)
    assert rest[-1].finish_reason in ("length", "stop")
    # Kept a short while (finished_ttl_s), so a client that lost the last chunks can resume.
    finished = asyncio.run(read())
    assert finished.status == "finished" and finished.finish_reason == rest[-1].finish_reason
    assert finished.tokens[:len(record.tokens)] == record.tokens and len(finished.tokens) > len(record.tokens)
    assert 0 < finished.ttl_s <= 300
    client = redis_sync.Redis.from_url(redis_url)
    assert 0 < client.ttl("specmesh:tokens:{live-1}") <= 300


def test_cancel_ends_the_stream(tiny_client):
    stream = tiny_client.stream(build_request("abc abc abc", max_new_tokens=400, k=1, session_id="cancel-me"))
    next(stream)
    next(stream)
    tiny_client.cancel("cancel-me")
    chunks = list(stream)
    assert chunks[-1].finish_reason == "cancelled"
    assert chunks[-1].stats.committed_tokens < 400
    with pytest.raises(grpc.RpcError) as info:   # released: cancelling again finds nothing
        tiny_client.cancel("cancel-me")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.asyncio
async def test_ttl_expires_an_abandoned_session(redis_url):
    store = SessionStore.from_url(redis_url, ttl_s=1)
    try:
        await store.create("ttl-1", [1, 2, 3], {"k": 1}, seed=5)
        assert (await store.get("ttl-1")).tokens == [1, 2, 3]
        await asyncio.sleep(2.2)
        assert await store.get("ttl-1") is None
    finally:
        await store.client.aclose()


@pytest.mark.asyncio
async def test_commit_is_atomic_and_checks_length(redis_url):
    store = SessionStore.from_url(redis_url, ttl_s=30)
    try:
        await store.create("atomic-1", [5, 6], {}, seed=1)
        handle = Handle("v:1", "atomic-1", 2)
        assert await store.commit("atomic-1", 2, [7, 8], 1, Handle(), handle) == "running"
        # A writer that missed the last step must not append on top of it.
        from orchestrator.sessions import CommitConflict

        with pytest.raises(CommitConflict):
            await store.commit("atomic-1", 2, [9], 2, Handle(), handle)
        record = await store.get("atomic-1")
        assert record.tokens == [5, 6, 7, 8] and record.step == 1 and record.verifier_handle == handle
        assert await store.cancel("atomic-1")
        assert await store.commit("atomic-1", 4, [9], 2, Handle(), handle) == "cancelled"
        assert (await store.get("atomic-1")).tokens == [5, 6, 7, 8]
        from specmesh.errors import AlreadyExists, NotFound

        with pytest.raises(AlreadyExists):
            await store.create("atomic-1", [1], {}, seed=1)
        assert await store.release("atomic-1")
        with pytest.raises(NotFound):
            await store.commit("atomic-1", 4, [9], 3, Handle(), handle)
        assert not await store.cancel("atomic-1")
    finally:
        await store.client.aclose()


@pytest.mark.asyncio
async def test_a_finished_record_stays_for_finished_ttl_s_then_its_id_is_free(redis_url):
    store = SessionStore.from_url(redis_url, ttl_s=60, finished_ttl_s=30)
    try:
        await store.create("done-1", [5, 6], {}, seed=1)
        await store.commit("done-1", 2, [7], 1, Handle(), Handle())
        assert not await store.finish("done-1", lease=2, finish_reason="stop")   # not its driver's lease
        assert await store.finish("done-1", lease=1, finish_reason="stop")
        record = await store.get("done-1")
        assert (record.status, record.finish_reason, record.tokens) == ("finished", "stop", [5, 6, 7])
        assert 0 < record.ttl_s <= 30
        assert not await store.cancel("done-1")      # nothing left to cancel
        await store.create("done-1", [8], {}, seed=2)   # a finished session's id starts a new one
        record = await store.get("done-1")
        assert (record.status, record.finish_reason, record.tokens, record.seed) == ("running", "", [8], 2)
    finally:
        await store.client.aclose()


@pytest.mark.asyncio
async def test_finished_ttl_s_0_deletes_a_finished_record(redis_url):
    store = SessionStore.from_url(redis_url, ttl_s=60, finished_ttl_s=0)
    try:
        await store.create("done-2", [5, 6], {}, seed=1)
        assert await store.finish("done-2", lease=1, finish_reason="length")
        assert await store.get("done-2") is None
    finally:
        await store.client.aclose()
