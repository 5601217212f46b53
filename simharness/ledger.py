"""The host thread's time at the measured levels: the engine's work against the harness's own.

The engine's work is the backend's phases (prep, launch, the readback wait and copy, the CPU proposer) and, at the
real level, the modelled host work spun for the scheduler and output processor. The rest of the wall time is the
harness's: per read-back step it is recorded (`Step.harness_s`), and the real level charges it against its next
modelled work (docs/hil.md, "The real loop's own host time"), unless the host then blocked on the device: harness
time spent while the device was still busy delayed nothing. What one modelled work cannot absorb is owed by the
next, so that over a cycle the host takes the longer of the modelled work and the loop's own, not the sum of each
piece's longer.
"""

from __future__ import annotations

import time

Mark = tuple[float, float]  # the wall clock and the engine's time then


class HostLedger:
    """All the engine's host time so far; a mark lets a reader take the time outside it since. `charge_mark`: where
    the harness time not yet charged to modelled work begins (`charge`); `owed_s`: harness time charged before it
    that the modelled work then could not absorb."""

    def __init__(self) -> None:
        self.engine_s = 0.0
        self.owed_s = 0.0
        self.charge_mark = self.mark()

    def engine(self, seconds: float) -> None:
        """Count `seconds` of host time as the engine's work."""
        self.engine_s += seconds

    def mark(self) -> Mark:
        return time.perf_counter(), self.engine_s

    def outside(self, mark: Mark) -> float:
        """Wall time since `mark` outside the engine's work."""
        return (time.perf_counter() - mark[0]) - (self.engine_s - mark[1])

    def charge(self, budget: float) -> float:
        """What a modelled work of `budget` seconds absorbs of the harness time not yet absorbed (owed, then since the
        last charge); the rest is owed by the next."""
        owed = self.owed_s + max(self.outside(self.charge_mark), 0.0)
        self.charge_mark = self.mark()
        absorbed = min(owed, budget)
        self.owed_s = owed - absorbed
        return absorbed

    def drop(self) -> None:
        """Nothing owed or to charge from here (the host waited for work that was not the loop's)."""
        self.charge_mark, self.owed_s = self.mark(), 0.0

    def blocked(self, mark: Mark) -> None:
        """The host blocked on the device from `mark` (taken as the wait began): the harness time before it, and what
        was owed, ran while the device worked, so it delayed nothing and is not charged."""
        self.charge_mark, self.owed_s = mark, 0.0
