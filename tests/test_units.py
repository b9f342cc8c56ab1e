"""Small pieces: n-gram lookup, streamed text and stop strings, the session
store's bounds, configuration from the environment, Redis URL passwords."""
from __future__ import annotations

import pytest

from draft_service.drafters import REGISTRY
from draft_service.drafters.ngram import lookup
from orchestrator.text import TextStream
from specmesh.session_cache import SessionCache
from specmesh.errors import CacheMiss, InvalidArgument
from specmesh.kv import TokenHistory


def test_ngram_lookup_prefers_longest_and_latest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # suffix (2, 3) last seen followed by 4, 5, 7
    assert lookup(tokens, 3, max_ngram=3, min_ngram=1) == [4, 5, 7]
    assert lookup([5, 6, 7], 2, 3, 1) == []
    assert lookup([1, 2, 1], 4, 3, 1) == [2, 1]          # copies up to the end, never past it
    assert lookup([8, 8, 8, 8], 2, 3, 1) == [8]


def test_drafters_register_themselves():
    assert {"ngram", "model"} <= set(REGISTRY)


def test_token_history_sync_and_cache_miss():
    h = TokenHistory("s")
    h.sync(0, [1, 2, 3])
    h.tokens.extend([7, 8])          # drafts
    h.sync(4, [9])                   # one draft accepted, then the recovered token
    assert h.tokens == [1, 2, 3, 7, 9]
    with pytest.raises(CacheMiss):
        h.sync(6, [1])
    with pytest.raises(InvalidArgument):   # a negative start would crop from the end
        h.sync(-2, [])
    assert h.tokens == [1, 2, 3, 7, 9]


def test_a_cache_proves_its_prefix_or_misses():
    from specmesh.fingerprint import PrefixFingerprints

    committed = PrefixFingerprints([1, 2, 3])
    h = TokenHistory("s")
    h.sync(0, [1, 2, 3])
    h.tokens.extend([7, 8])                                   # drafts
    committed.extend([7, 9])                                  # the orchestrator committed 7, then recovered 9
    h.sync(4, [9], committed.at(4))
    assert h.tokens == [1, 2, 3, 7, 9] and h.fingerprint(5) == committed.at(5)
    poisoned = TokenHistory("s")
    poisoned.sync(0, [1, 2, 4, 7, 9])                         # same length, one token different
    with pytest.raises(CacheMiss, match="prefix fingerprint"):
        poisoned.sync(5, [1], committed.at(5))
    with pytest.raises(CacheMiss, match="prefix fingerprint"):
        h.sync(5, [1], 0)                                     # a caller that sends no fingerprint proves nothing
    h.sync(0, [5], 0)                                         # a full resend has nothing to prove


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def test_text_stream_holds_back_a_possible_stop_string():
    ts = TextStream(FakeTokenizer(), stop=["END"])
    out = ts.update([ord(c) for c in "hello E"], final=False)
    assert out == "hello"            # "E" could start "END"
    out += ts.update([ord(c) for c in "hello EN"], final=False)
    out += ts.update([ord(c) for c in "hello ENDING"], final=False)
    assert ts.stopped and out == "hello " and ts.text == "hello "


def test_text_stream_without_stop_and_final_flush():
    ts = TextStream(FakeTokenizer())
    assert ts.update([104, 105], final=False) == "hi"
    assert ts.update([104, 105, 0xFFFD], final=False) == ""      # incomplete character waits
    assert ts.update([104, 105, 33], final=True) == "!"


def test_session_store_bounds():
    now = [0.0]
    store = SessionCache(max_sessions=2, idle_ttl_s=10, clock=lambda: now[0])
    store.put("a", 1)
    store.put("b", 2)
    store.get("a")
    store.put("c", 3)                # evicts b, the least recently used
    assert store.get("b") is None and store.get("a") == 1 and len(store) == 2
    now[0] = 11
    assert store.get("a") is None and len(store) == 0 and store.evictions == 3


def test_a_shorter_draft_context_bounds_requests_that_use_it():
    from orchestrator.requests import Limits, validate
    from specmesh.client import build_request
    from specmesh.errors import InvalidArgument

    limits = Limits(max_context=512, vocab_size=50, max_k=8, default_k=4, default_max_new_tokens=64,
                    drafters=frozenset({"ngram", "model"}), default_drafter="ngram", drafter_context={"model": 100})
    prompt = [1] * 90
    with pytest.raises(InvalidArgument) as info:
        validate(build_request(prompt, max_new_tokens=20, k=2, drafter="model"), prompt, limits)
    assert info.value.field == "max_new_tokens" and "context of 100" in info.value.message
    assert validate(build_request(prompt, max_new_tokens=20, k=2, drafter="ngram"), prompt, limits).max_new_tokens == 20
    assert validate(build_request(prompt, max_new_tokens=20, k=0, drafter="model"), prompt, limits).k == 0


def test_a_long_feed_in_chunks_gives_the_same_logits(tmp_path, monkeypatch):
    import torch

    from specmesh import kv
    from specmesh.models import load_model
    from tests.tiny_models import build_tiny_model

    loaded = load_model(str(build_tiny_model(tmp_path / "t", seed=3)))
    tokens = [(5 * i + 1) % 40 + 3 for i in range(100)]
    whole = kv.KVSession("w", loaded.model)
    whole.sync(0, tokens)
    expected = whole.forward([7, 8])
    monkeypatch.setattr(kv, "PREFILL_CHUNK", 16)
    chunked = kv.KVSession("c", loaded.model)
    chunked.sync(0, tokens)
    got = chunked.forward([7, 8])
    assert torch.allclose(got, expected, atol=1e-4) and bool((got.argmax(-1) == expected.argmax(-1)).all())
    assert chunked.cached_len == whole.cached_len == len(tokens) + 2


def test_work_whose_caller_went_away_stops_at_its_next_check():
    import asyncio
    import threading
    import time

    from specmesh.engine_host import Abandoned, EngineHost, check_abandoned

    stopped = threading.Event()

    class Engine:
        def long_prefill(self):
            try:
                for _ in range(200):            # 20 s of "chunks" unless abandoned
                    check_abandoned()
                    time.sleep(0.1)
            except Abandoned:
                stopped.set()
                raise

    async def main():
        host = EngineHost("test engine")
        host.engine = Engine()
        call = asyncio.ensure_future(host.run(host.engine.long_prefill))
        await asyncio.sleep(0.3)
        call.cancel()                          # the deadline passed, or the client went away
        started = time.monotonic()
        while not stopped.is_set() and time.monotonic() - started < 5:
            await asyncio.sleep(0.05)
        return stopped.is_set()

    assert asyncio.run(main())


def test_a_model_is_loaded_on_the_thread_that_runs_its_forwards():
    """EngineHost.load runs on the model thread (a thread that ran torch's parallel ops keeps an OpenMP
    team of its own, and more teams than cores make every team sleep between a forward's regions)."""
    import asyncio
    import threading

    from specmesh.engine_host import EngineHost

    class Engine:
        def where(self):
            return threading.get_ident()

    async def main():
        host = EngineHost("test engine")
        loaded_on = await host.load(lambda model, *, kernels: (threading.get_ident(), model, kernels), "m",
                                    kernels="packed")
        host.engine = Engine()
        return loaded_on, await host.run(host.engine.where)

    (loaded_on, model, kernels), ran_on = asyncio.run(main())
    assert (model, kernels) == ("m", "packed")
    assert loaded_on == ran_on != threading.get_ident()
