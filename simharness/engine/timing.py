"""Device timing: the parts of a launch on CUDA (with the hil level's GPU hold), and the real level's device clock.

A launch enqueues its parts one after another: each prefill chunk, then the decode step (whose phases the
decode loop's own events time). With `hold` (hil) each part is preceded by a spin kernel
(`torch.cuda._sleep`) long enough that the host finishes enqueueing the part before the device reaches it,
so its events time the device work alone, not gaps where the device waited for eager launches; docs/hil.md
says how the hold is sized and what went wrong before. Without it (the real level) the device runs each
kernel as it arrives and the events time what really happened. Either way the timing's own host time is
harness time, kept in `host_s` and left out of the measured launch.
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

# Host enqueue times kept to size the hold, and the first guesses.
ENQUEUE_WINDOW = 16
FIRST_STEP_ENQUEUE_S = 3e-3
FIRST_PREFILL_ENQUEUE_S = 10e-3
HOLD_FACTOR = 3.0  # times the fastest recent enqueue
HOLD_MARGIN_S = 5e-4


class PartTiming:
    """Times the parts of each launch on one CUDA stream; `hold` adds the GPU hold before each part."""

    def __init__(self, hold: bool):
        self.hold = hold
        self.enqueue = {"prefill": deque([FIRST_PREFILL_ENQUEUE_S], maxlen=ENQUEUE_WINDOW),
                        "step": deque([FIRST_STEP_ENQUEUE_S], maxlen=ENQUEUE_WINDOW)}  # fmt: skip
        self.cycles_per_s = sleep_rate() if hold else 0.0
        self.host_s = 0.0  # host time of the timing itself in the current launch (harness time)
        self.starved = False  # the current launch had a part whose enqueue outlasted its hold

    def start_launch(self) -> None:
        self.host_s, self.starved = 0.0, False

    def before(self, part: str, events: list | None) -> float:
        """Before a part is enqueued: hold the GPU (hil) and, given `events`, record the part's start there.
        Returns the hold's length (inf without one).

        The hold is three times the fastest recent enqueue of such parts plus 0.5 ms: an enqueue the host spent
        blocked must not grow the next hold. From the third prefill chunk of a launch on, the host first waits
        for the end of the chunk two back, so that holds cannot fill the stream's launch queue."""
        t = time.perf_counter()
        hold = math.inf
        if self.hold:
            if events is not None and len(events) >= 4:
                events[-3].synchronize()  # the end of the chunk two back
            hold = HOLD_FACTOR * min(self.enqueue[part]) + HOLD_MARGIN_S
            torch.cuda._sleep(int(hold * self.cycles_per_s))
        if events is not None:
            record(events)
        self.host_s += time.perf_counter() - t
        return hold

    def after(self, part: str, enqueue_s: float, hold: float) -> None:
        """A part took `enqueue_s` of host time to enqueue after a hold of `hold` seconds."""
        self.enqueue[part].append(enqueue_s)
        self.starved |= enqueue_s > hold

    def mark(self, events: list) -> None:
        """Record the end of a part (or of the launch) in `events`."""
        t = time.perf_counter()
        record(events)
        self.host_s += time.perf_counter() - t


def record(events: list) -> None:
    """Record a new timing event on the current stream and append it to `events`."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    events.append(event)


_SLEEP_RATE: list[float] = []


def sleep_rate() -> float:
    """GPU clock cycles per second of `torch.cuda._sleep`, measured once per process."""
    if not _SLEEP_RATE:
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # warm-up
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_RATE.append(cycles / (start.elapsed_time(end) / 1e3))
    return _SLEEP_RATE[0]


class DeviceClock:
    """Device timestamps on the host's clock, in seconds since `t0` (the real level): CUDA events timed from a
    reference event recorded, on an idle device, when the clock started; on the CPU, where the work runs
    inside the host's calls, the host's own clock."""

    def __init__(self, cuda: bool, t0: float):
        self.cuda, self.t0 = cuda, t0
        if cuda:
            torch.cuda.synchronize()
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            self.reference.synchronize()
            self.reference_s = time.perf_counter() - t0

    def mark(self):
        """A mark at this point of the stream (an event recorded on it), or of the host on the CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, mark) -> float:
        """When the device passed `mark` (it must have: wait for it first)."""
        if not self.cuda:
            return mark - self.t0
        return self.reference_s + self.reference.elapsed_time(mark) / 1e3
