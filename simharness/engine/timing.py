"""Device timing: the parts of a launch on CUDA (with the hil level's gate), and the real level's device clock.

A launch enqueues its parts one after another: each prefill chunk, then the decode step (whose phases the
decode loop's own events time). With the gate (hil) the device waits in front of each part until the host has
enqueued all of it (`kernels.gate`), so the part's events time the device work alone, not gaps where the
device waited for eager launches, a compile or a blocked host; docs/hil.md says why a gate and not a spin of
fixed length. Without it (the real level) the device runs each kernel as it arrives and the events time what
really happened. Either way the timing's own host time is harness time, kept in `host_s` and left out of the
measured launch.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from simharness.kernels.gate import MAX_POLLS, Gate

# An enqueue longer than this may have outlasted the gate's polls (about 4 us each on the H100; 1 us is taken as
# the fastest a poll could be).
STARVED_S = MAX_POLLS * 1e-6


class PartTiming:
    """Times the parts of each launch on one CUDA stream; `gate` (hil) closes a gate in front of each part."""

    def __init__(self, gate: bool):
        self.gate = Gate() if gate else None
        self.host_s = 0.0  # host time of the timing itself in the current launch (harness time)
        self.starved = False  # the current launch had a part whose enqueue may have outlasted its gate

    def start_launch(self) -> None:
        self.host_s, self.starved = 0.0, False

    def before(self, events: list | None) -> None:
        """Before a part is enqueued: close the gate (hil) and, given `events`, record the part's start there; without
        the gate (real) only the first part's start, which opens the launch's device window (each event recorded costs
        the host 12-38 µs on the H100 machines, and the real loop's timeline carries it: docs/hil.md). From the third
        prefill chunk of a launch on, hil first waits for the end of the chunk two back, so that a host far ahead of
        the device does not fill the stream's launch queue and block in its enqueue."""
        t = time.perf_counter()
        if self.gate is not None:
            if events is not None and len(events) >= 4:
                events[-3].synchronize()  # the end of the chunk two back
            self.gate.close()
        if events is not None and (self.gate is not None or not events):
            record(events)
        self.host_s += time.perf_counter() - t

    def after(self, enqueue_s: float) -> None:
        """The host enqueued the part in `enqueue_s`: open the gate (hil)."""
        if self.gate is not None:
            t = time.perf_counter()
            self.gate.open()
            self.starved |= enqueue_s > STARVED_S
            self.host_s += time.perf_counter() - t

    def part_end(self, events: list) -> None:
        """Record the end of a part in `events` (hil: each part is timed alone; the real level times the window)."""
        if self.gate is not None:
            self.mark(events)

    def mark(self, events: list) -> None:
        """Record an event in `events` now: the end of a part (`part_end`) or of the launch."""
        t = time.perf_counter()
        record(events)
        self.host_s += time.perf_counter() - t


def record(events: list) -> None:
    """Record a new timing event on the current stream and append it to `events`."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    events.append(event)


# How far back the device clock looks for its tightest anchor: long enough to hold many waits, short enough that the
# drift between the GPU's timer and the host's clock (24 us a second measured on the H100 machine, docs/hil.md,
# "The real level's device clock") moves the offset by about a microsecond within it.
ANCHOR_WINDOW_S = 0.05


class Anchors:
    """The offset from a device timestamp to the host's clock, from the waits the host blocked on: each says the host
    woke at `host`, a little after the device passed `device` (the wake-up is never early, so the smallest offset
    of the recent ones is the tightest). Recent only: the two clocks drift apart."""

    def __init__(self, device: float, host: float):
        self.recent: deque[tuple[float, float]] = deque([(device, host - device)])

    def add(self, device: float, host: float) -> None:
        recent = self.recent
        recent.append((device, host - device))
        while len(recent) > 1 and recent[0][0] < device - ANCHOR_WINDOW_S:
            recent.popleft()

    def offset(self) -> float:
        return min(offset for _, offset in self.recent)


class DeviceClock:
    """Device timestamps on the host's clock (`time.perf_counter` seconds): CUDA events timed from a reference event
    recorded, on an idle device, when the clock started, shifted by the offset of the latest waits the host blocked
    on (`Anchors`); on the CPU, where the work runs inside the host's calls, the host's own clock. The real level
    reads each step's device window with it (on CUDA the step's own events); both measured levels read the host's
    wake-up at each blocking wait."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            torch.cuda.synchronize()
            self.reference = torch.cuda.Event(enable_timing=True)
            self.reference.record()
            self.reference.synchronize()
            self.reference_s = time.perf_counter()
            self.anchors = Anchors(self.reference_s, self.reference_s)

    def mark(self):
        """A mark at this point of the stream (an event recorded on it), or of the host on the CPU."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wait(self, mark) -> float | None:
        """Block until the device passes `mark`; when the host had to block, its wake-up anchors the clock anew.
        Returns how much later than the tightest recent wake-up the host woke (None when it did not block): the
        part of a wake-up that varies from wait to wait (`seconds` puts the tightest at the device's own time)."""
        if not self.cuda or mark.query():
            return None
        mark.synchronize()
        host = time.perf_counter()
        device = self._timer(mark)
        self.anchors.add(device, host)
        return host - device - self.anchors.offset()

    def seconds(self, mark) -> float:
        """When the device passed `mark` (it must have: wait for it first)."""
        if not self.cuda:
            return mark
        return self._timer(mark) + self.anchors.offset()

    def seconds_of(self, marks: list) -> tuple[float, ...]:
        """`seconds` of each of `marks` (events on the stream: the step's own, or the clock's)."""
        if not self.cuda:
            return tuple(marks)
        offset = self.anchors.offset()  # the tightest anchor, found once for all of them
        return tuple(self._timer(m) + offset for m in marks)

    def _timer(self, mark) -> float:
        """The device's own time of `mark`, in seconds on the host's clock as it stood at the reference."""
        return self.reference_s + self.reference.elapsed_time(mark) / 1e3
