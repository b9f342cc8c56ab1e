"""Verify calls from different sessions share one forward pass.

Calls that arrive while the model is busy wait in a queue; when it frees up,
every waiting call (up to max_batch) goes into the next forward pass together.
One session alone pays no extra latency; under load, the per-token weight
reads are shared, which is where a memory-bound accelerator gains throughput.

Sessions have caches of different lengths and feed different numbers of
tokens, so the batch is built with each cache left-padded to the longest and
each input right-padded, masked by the attention mask, with explicit position
ids; afterwards each session gets its own unpadded cache back.
"""
from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from specmesh import telemetry, tree
from specmesh.engine_host import Caller, EngineHost, caller
from specmesh.errors import ResourceExhausted
from specmesh.kv import KVSession
from specmesh.lean_decoder import lm_forward
from specmesh.models import custom_attention_mask
from specmesh.padded_cache import new_cache


@torch.inference_mode()
def batched_forward(model, sessions: Sequence[KVSession], extras: Sequence[Sequence[int]],
                    features: Sequence[bool] | None = None,
                    parents: Sequence[Sequence[int] | None] | None = None) -> list[torch.Tensor]:
    """KVSession.forward for several sessions in one pass; same results, row for row.

    `features[i]`: also keep session i's features of the positions it fed in its
    `fed_features` (the pass returns hidden states only when some session asks).
    `parents[i]`: session i's extras are a draft tree (specmesh.tree); None: a chain.

    Sessions without any cache yet (a first call, or one rebuilding after a cache
    miss) run on their own: their whole prompt is the work, and an empty cache has
    no tensors to pad.
    """
    features = list(features) if features is not None else [False] * len(sessions)
    parents = [None if p is None or tree.is_chain(p) else list(p) for p in parents] if parents is not None \
        else [None] * len(sessions)
    fresh = [i for i, s in enumerate(sessions) if s.cached_len == 0]
    if fresh and len(sessions) > 1:
        warm = [i for i in range(len(sessions)) if i not in fresh]
        rows = dict(zip(warm, batched_forward(model, [sessions[i] for i in warm], [extras[i] for i in warm],
                                              [features[i] for i in warm], [parents[i] for i in warm])))
        rows.update({i: sessions[i].forward(extras[i], features=features[i], parents=parents[i]) for i in fresh})
        return [rows[i] for i in range(len(sessions))]
    if len(sessions) <= 1:
        return [s.forward(e, features=f, parents=p) for s, e, f, p in zip(sessions, extras, features, parents)]
    feeds, lengths = [], []
    for s, extra in zip(sessions, extras):
        keep, feed = s.feed(extra)
        feeds.append(feed)
        lengths.append(keep)
    n, past, width = len(sessions), max(lengths), max(len(f) for f in feeds)
    device = model.device
    input_ids = torch.zeros(n, width, dtype=torch.long, device=device)               # [n, T]
    mask = torch.zeros(n, past + width, dtype=torch.long, device=device)             # [n, L + T]
    positions = torch.zeros(n, width, dtype=torch.long, device=device)               # [n, T]
    trees = any(p is not None for p in parents)
    if trees:   # one 4D mask for all: each tree's nodes see their ancestors, padding sees its own row's tokens
        mask = torch.zeros(n, 1, width, past + width, dtype=torch.bool, device=device)   # [n, 1, T, L + T]
    for i, (feed, length, tree_parents) in enumerate(zip(feeds, lengths, parents)):
        input_ids[i, :len(feed)] = torch.tensor(feed, device=device)
        positions[i] = torch.arange(length, length + width, device=device)
        if not trees:
            mask[i, past - length:past + len(feed)] = 1
            continue
        offsets, allowed = tree.feed_layout(len(feed) - len(tree_parents or ()), tree_parents or [], device)
        positions[i, :len(feed)] = length + offsets
        mask[i, 0, :, past - length:past + len(feed)] = True                           # padding rows: see all
        mask[i, 0, :len(feed), past:past + len(feed)] = allowed
    if trees:
        mask = custom_attention_mask(model, mask)
    batch_cache = new_cache(model.config)
    for layer in range(len(sessions[0].cache.layers) if past else 0):
        keys, values = [], []
        for s, length in zip(sessions, lengths):
            k, v = s.layer_kv(layer)                                                   # [1, H, length, D]
            pad = past - length
            keys.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
        batch_cache.update(torch.cat(keys), torch.cat(values), layer)                  # [n, H, L, D]
    logits, hidden = lm_forward(model, input_ids, batch_cache, mask, positions, hidden=any(features))
    logits = logits.float()                                                            # [n, T, V]; hidden [n, T, H]
    rows = []
    for i, (s, feed, length, extra) in enumerate(zip(sessions, feeds, lengths, extras)):
        s.fed_features = (length, hidden[i, :len(feed)]) if features[i] else None      # only its unpadded rows
        layers = [(layer.keys[i:i + 1, :, past - length:past + len(feed)].contiguous(),
                   layer.values[i:i + 1, :, past - length:past + len(feed)].contiguous())
                  for layer in batch_cache.layers]
        s.replace_cache(layers)
        s.took(extra, parents[i])
        rows.append(logits[i, len(feed) - len(extra) - 1:len(feed)])                   # [len(extra) + 1, V]
    return rows


@dataclass
class _Pending:
    call: Any                                  # a verifier_service.engine.VerifyCall
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    caller: Caller = field(default_factory=caller)   # the Verify's span and arrival time


class VerifyBatcher:
    """Feeds queued Verify calls to the engine's `verify_batch`, as many as wait at once."""

    def __init__(self, host: EngineHost, max_batch: int, window_s: float = 0.0, max_queue: int = 1024):
        self.host = host
        self.max_batch = max(1, max_batch)
        self.window_s = window_s
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=max_queue)
        self._task: asyncio.Task | None = None
        host.waiting_elsewhere.append(self.queue.qsize)   # the queue-depth gauge counts calls waiting here too

    @property
    def depth(self) -> int:
        return self.queue.qsize()

    async def submit(self, call) -> Any:
        if self._task is None or self._task.done():
            # A fresh context: the loop must not run under the first caller's span.
            self._task = contextvars.Context().run(asyncio.get_running_loop().create_task, self._run())
        pending = _Pending(call)
        try:
            self.queue.put_nowait(pending)
        except asyncio.QueueFull:
            raise ResourceExhausted(f"{self.queue.qsize()} Verify calls are already queued on this verifier; "
                                    "retry later or add verifier replicas") from None
        return await pending.future

    async def _run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            if self.window_s and self.queue.empty():
                await asyncio.sleep(self.window_s)
            while len(batch) < self.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            batch = [p for p in batch if not p.future.cancelled()]
            if not batch:
                continue
            telemetry.record("verify_batch_size", len(batch), {"tier": "verifier"})
            try:
                engine = self.host.require()
                results = await self.host.run_batch(engine.verify_batch, [p.caller for p in batch],
                                                    [p.call for p in batch])
            except Exception as error:  # noqa: BLE001 - the engine failed as a whole: fail every caller
                results = [error] * len(batch)
            for pending, result in zip(batch, results):
                if pending.future.cancelled():
                    continue
                if isinstance(result, Exception):
                    pending.future.set_exception(result)
                else:
                    pending.future.set_result(result)
