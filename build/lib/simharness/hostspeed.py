"""A gauge of the host CPU's speed, timed around each measured run.

A decode loop of a small model is host-bound: its TPOT follows the host's speed. On a shared machine the host
slows down in spells (docs/hil.md, "The host's speed"), so a run measured in a spell is not comparable with one
measured outside it. The gauge times a fixed pure-Python workload (the interpreter's speed is what the
host phases need) before and after a run; the run's slowdown is the slower of the two against the fastest time
this process has seen.
"""

from __future__ import annotations

import math
import time

REPEATS = 5  # timings per probe; their median is the probe's (and probes at start, for the first fastest)
RETRIES = 2  # at most this many more runs of a point measured in a spell (`engine.host_slowdown`)
ITERATIONS = 2000  # the workload's loop: a fraction of a millisecond of interpreter work (docs/hil.md)


def _workload() -> int:
    """A fixed piece of interpreter work: a loop, integer arithmetic, a dict."""
    seen: dict[int, int] = {}
    total = 0
    for i in range(ITERATIONS):
        total += (i * 7) % 13
        seen[i & 63] = total
    return total + len(seen)


class HostGauge:
    """The fixed workload's time now (`probe`) and the fastest time seen (`fastest_s`), in seconds."""

    def __init__(self) -> None:
        self.fastest_s = math.inf
        for _ in range(REPEATS):
            self.probe()

    def probe(self) -> float:
        times = []
        for _ in range(REPEATS):
            t = time.perf_counter()
            _workload()
            times.append(time.perf_counter() - t)
        now = sorted(times)[REPEATS // 2]
        self.fastest_s = min(self.fastest_s, now)
        return now

    def slowdown(self, before_s: float, after_s: float) -> float:
        """How many times slower than its fastest the host was around a run probed `before_s` and `after_s`."""
        return max(before_s, after_s) / self.fastest_s
