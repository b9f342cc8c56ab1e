"""Draft only while a session's drafts pay for themselves.

A drafted step costs more than a plain target step: the draft's time, a second
RPC and a wider verify (on this CPU about 1.3 plain steps with the default
drafter, docs/distill.md). It pays when it commits more tokens than it costs,
and a session whose drafts keep missing (sampled text far from what the draft
learned, a prompt lookup that never matches) is faster without them. So each
session keeps a running mean of the tokens its drafted steps commit, starting
from a hopeful one token above the cost (a few bad steps in a row, not one,
stop drafting); while that mean is below the drafted step's cost, it decodes
plain steps for a while (4, then 8, ... up to 32 steps), then drafts once more
to look again.

The schedule depends only on what the session committed, never on timings, so
a request sent again with the same seed drafts on the same steps and samples
the same output (its draws depend on (seed, position) and on what was drafted
there). The output is the target's either way: a plain step is a draft of none.
"""
from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.3       # weight of the newest drafted step in the running mean
FIRST_PAUSE = 4       # plain steps after the mean first falls below the cost
LONGEST_PAUSE = 32    # the pause doubles while looking again finds no better


@dataclass
class Pacer:
    """One session's drafting schedule. `step_cost`: a drafted step's time in plain steps (<= 1: always draft)."""

    step_cost: float
    mean: float = 0.0             # committed tokens per drafted step, smoothed (starts at step_cost + 1)
    pause: int = 0                # the length of the current (or last) pause, 0: none yet
    left: int = 0                 # plain steps still to run in it

    def __post_init__(self):
        self.mean = self.mean or self.step_cost + 1.0

    def k(self, requested: int) -> int:
        """The draft tokens this step asks for: `requested`, or 0 during a pause."""
        if self.left > 0 and requested > 0:
            self.left -= 1
            return 0
        return requested

    def observe(self, drafted: int, committed: int) -> None:
        """A step that proposed `drafted` tokens committed `committed` (its accepted ones plus one of the
        target's). Steps without drafts say nothing of the draft and leave the schedule as it was."""
        if drafted <= 0 or self.step_cost <= 1.0:
            return
        self.mean += SMOOTHING * (committed - self.mean)
        if self.mean < self.step_cost:
            self.pause = min(2 * self.pause, LONGEST_PAUSE) if self.pause else FIRST_PAUSE
            self.left = self.pause
        else:
            self.pause = self.left = 0

    def state(self) -> str:
        """The schedule as the session record keeps it (repr: the mean comes back to the bit)."""
        return f"{self.mean!r} {self.pause} {self.left}"

    @classmethod
    def restore(cls, step_cost: float, state: str) -> "Pacer":
        """The schedule a record kept (a fresh one for "", a record from before pacing, or another format)."""
        try:
            mean, pause, left = state.split()
            return cls(step_cost, float(mean), int(pause), int(left))
        except ValueError:
            return cls(step_cost)
