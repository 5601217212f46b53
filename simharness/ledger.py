"""The host thread's time at the measured levels: the engine's work against the harness's own.

The engine's work is the backend's phases (prep, launch, the readback wait and copy, the CPU proposer) and, at the
real level, the modelled host work spun for the scheduler and output processor. The rest of the wall time is the
harness's: per read-back step it is recorded (`Step.harness_s`), and the real level charges it against its next
modelled work (docs/hil.md, "The real loop's own host time"), unless the host then blocked on the device: harness
time spent while the device was still busy delayed nothing.
"""

from __future__ import annotations

import time

Mark = tuple[float, float]  # the wall clock and the engine's time then


class HostLedger:
    """All the engine's host time so far; a mark lets a reader take the time outside it since. `charge_mark`: where
    the harness time not yet charged to modelled work begins (`charge`)."""

    def __init__(self) -> None:
        self.engine_s = 0.0
        self.charge_mark = self.mark()

    def engine(self, seconds: float) -> None:
        """Count `seconds` of host time as the engine's work."""
        self.engine_s += seconds

    def mark(self) -> Mark:
        return time.perf_counter(), self.engine_s

    def outside(self, mark: Mark) -> float:
        """Wall time since `mark` outside the engine's work."""
        return (time.perf_counter() - mark[0]) - (self.engine_s - mark[1])

    def charge(self) -> float:
        """The harness time not yet charged (at least 0), charged now: it starts again from here."""
        seconds = max(self.outside(self.charge_mark), 0.0)
        self.charge_mark = self.mark()
        return seconds

    def blocked(self, mark: Mark) -> None:
        """The host blocked on the device from `mark` (taken as the wait began): the harness time before it ran while
        the device worked, so it is not charged."""
        self.charge_mark = mark
