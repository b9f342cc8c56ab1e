"""The model thread of the draft and verifier tiers, and what it reports.

One thread owns the model and every session's cache, so engines need no locks
and the event loop stays free while torch runs. Servicers call engine methods
directly through it (`await host.run(engine.propose, ...)`). Each run is an
`engine.<method>` span under the caller's span, with its queue wait; a run that
serves several queued calls at once (a verifier batch) is one span *linked* to
each caller's span, the OpenTelemetry way to tie a batched pass to its callers.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple, Sequence, TypeVar

import grpc
from opentelemetry import trace

from specmesh import memory, telemetry
from specmesh.errors import ServiceError, Unavailable

R = TypeVar("R")

# The running job's "its caller gave up" flag, seen by engines on the model thread.
_abandoned: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("abandoned", default=None)


class Abandoned(ServiceError):
    """The caller went away (deadline passed, client cancelled): the work stopped early."""

    code = grpc.StatusCode.CANCELLED


def check_abandoned() -> None:
    """For long engine work: stop here when its caller no longer waits for it."""
    flag = _abandoned.get()
    if flag is not None and flag.is_set():
        raise Abandoned("the caller went away; the work was stopped")


class Caller(NamedTuple):
    """A call queued on its way to the model thread: its span and when it arrived."""

    span_context: trace.SpanContext
    submitted: float


def caller() -> Caller:
    """The current call as a Caller, to pass along with it through a queue."""
    return Caller(trace.get_current_span().get_span_context(), time.perf_counter())


class EngineHost:
    """Runs engine methods on one dedicated thread; UNAVAILABLE until the engine is attached."""

    def __init__(self, what: str, tier: str = ""):
        self.engine = None
        self.what, self.tier = what, tier
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=what)
        self._lock = threading.Lock()
        self.depth = 0                                   # calls handed to the thread, not yet started
        # Calls queued in front of the thread (a batcher's), counted as waiting too.
        self.waiting_elsewhere: list[Callable[[], int]] = []
        self.running = 0                                 # calls on the thread now (0 or 1)
        self.last_work = 0.0                             # when the thread last finished a call (monotonic)
        self._worked_since_trim = False
        self._detached: set[asyncio.Task] = set()       # runs whose caller stopped waiting

    @property
    def waiting(self) -> int:
        """What the queue-depth gauge shows."""
        return self.depth + sum(count() for count in self.waiting_elsewhere)

    def require(self):
        if self.engine is None:
            raise Unavailable(f"the {self.what} is still loading")
        return self.engine

    async def load(self, fn: Callable[..., R], *args, **kwargs) -> R:
        """fn(*args, **kwargs) on the model thread, before an engine is attached: load the model and set
        up its kernels (their probe forwards included) on the thread every later forward runs on.

        Why: each thread that runs a parallel torch op keeps an OpenMP team of its own (GNU OpenMP,
        torch's CPU builds), and once a process holds more team threads than it has cores, every team
        sleeps between parallel regions instead of spinning, and wakes for each of the hundreds in a
        forward pass. Loaded on asyncio's default threads, the 135M target's 1-token step took 53-58 ms
        on its 2 threads instead of 40-42 (an AMD EPYC of 2 cores; docs/benchmarks.md, "One thread
        for the model's work")."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def run(self, fn: Callable[..., R], *args) -> R:
        """fn(*args) on the model thread, under the caller's span."""
        abandoned = threading.Event()
        context = contextvars.copy_context()   # the thread runs under the caller's span
        context.run(_abandoned.set, abandoned)

        def job(waited: float):
            started = time.perf_counter()
            with telemetry.tracer().start_as_current_span(f"engine.{fn.__name__}") as span:
                if span.is_recording():
                    span.set_attribute(telemetry.ATTR_QUEUE_WAIT, waited)
                try:
                    return fn(*args)
                finally:
                    self._record(fn.__name__, [waited], time.perf_counter() - started)

        try:
            return await self._submit(lambda waited: context.run(job, waited))
        except asyncio.CancelledError:
            abandoned.set()   # the job, if it is running, stops at its next check_abandoned()
            raise

    async def run_even_if_abandoned(self, fn: Callable[..., R], *args) -> R:
        """fn(*args) on the model thread, done even when its caller stops waiting: a Release queued
        behind long prefills outlives its caller's deadline, and a dropped one would leave its cache
        in memory until the idle TTL."""
        task = asyncio.ensure_future(self.run(fn, *args))
        self._detached.add(task)   # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._detached.discard)
        return await asyncio.shield(task)

    async def run_batch(self, fn: Callable[..., R], callers: Sequence[Caller], *args) -> R:
        """fn(*args) once for several queued calls: one span, linked to each caller's."""
        def job(_):
            started = time.perf_counter()
            waits = [started - c.submitted for c in callers]
            links = [trace.Link(c.span_context) for c in callers if c.span_context.is_valid]
            # A root span: the batch belongs to no single caller's trace.
            with telemetry.tracer().start_as_current_span(
                    f"engine.{fn.__name__}", context=trace.set_span_in_context(trace.INVALID_SPAN), links=links,
                    attributes={telemetry.ATTR_BATCH_SIZE: len(callers), telemetry.ATTR_QUEUE_WAIT: max(waits)}):
                try:
                    return fn(*args)
                finally:
                    self._record(fn.__name__, waits, time.perf_counter() - started)

        return await self._submit(job)

    async def _submit(self, job: Callable[[float], R]) -> R:
        """Queue `job(seconds waited)` for the thread, counted in `depth` until it starts or is cancelled."""
        self.require()
        submitted, waiting = time.perf_counter(), [True]
        with self._lock:
            self.depth += 1

        def leave() -> None:
            with self._lock:
                if waiting[0]:
                    waiting[0] = False
                    self.depth -= 1

        def start():
            leave()
            self.running += 1
            try:
                return job(time.perf_counter() - submitted)
            finally:
                self.running -= 1
                self.last_work, self._worked_since_trim = time.monotonic(), True

        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, start)
        finally:
            leave()   # a call cancelled before it started is no longer waiting

    async def give_back_memory_when_idle(self, quiet_s: float = 2.0) -> None:
        """Forever: once the thread has been quiet for `quiet_s` after work, hand the memory that
        work freed (dropped KV caches) back to the OS; specmesh.memory says why it is needed. The
        trim runs on the thread itself, so never beside a forward pass, and a call arriving
        meanwhile waits for it (~0.1 s). Under steady load it never runs: freed memory is reused."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(quiet_s / 2)
            if (not self._worked_since_trim or self.running or self.waiting
                    or time.monotonic() - self.last_work < quiet_s):
                continue
            self._worked_since_trim = False
            await loop.run_in_executor(self._executor, memory.trim)

    def _record(self, method: str, waits: Sequence[float], seconds: float) -> None:
        if telemetry.metrics_enabled():
            attrs = {"tier": self.tier, "method": method}
            for wait in waits:
                telemetry.record("engine_queue_wait", wait, attrs)
            telemetry.record("engine_call_duration", seconds, attrs)
