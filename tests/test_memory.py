"""Resident memory given back after load: glibc keeps what growing KV caches freed
until malloc_trim, and a replica trims once it goes quiet, on its model thread."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from specmesh import memory
from specmesh.engine_host import EngineHost


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _grow_and_drop_caches() -> None:
    """What a replica does under load: 120 KV caches growing by torch.cat, then all dropped."""
    caches = [torch.zeros(1, 3, 1, 64) for _ in range(120)]      # [1, H, S, D]
    for _ in range(30):
        caches = [torch.cat([c, torch.ones(1, 3, 16, 64)], dim=2) for c in caches]


def test_trim_gives_back_what_dropped_caches_left_resident():
    worker = threading.Thread(target=lambda: [_grow_and_drop_caches() for _ in range(2)])   # a model thread
    worker.start()
    worker.join()
    freed = _rss_mb()
    assert memory.trim()
    assert _rss_mb() < freed - 20


@pytest.mark.asyncio
async def test_the_host_trims_once_when_quiet_after_work_on_its_own_thread(monkeypatch):
    trims = []
    monkeypatch.setattr(memory, "trim", lambda: trims.append(threading.current_thread().name))
    host = EngineHost("model", tier="test")
    host.engine = object()
    trimming = asyncio.ensure_future(host.give_back_memory_when_idle(quiet_s=0.2))
    try:
        await asyncio.sleep(0.6)
        assert trims == []                     # no work yet: nothing to give back
        await host.run(lambda: None)
        while not trims:
            await asyncio.sleep(0.05)
        assert trims[0].startswith("model")    # on the model thread, never beside a forward pass
        await asyncio.sleep(0.6)
        assert len(trims) == 1                 # once per quiet spell after work
        await host.run(lambda: None)
        while len(trims) < 2:
            await asyncio.sleep(0.05)
    finally:
        trimming.cancel()
